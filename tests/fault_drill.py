"""launch/pretrain_gpt.py with one injected fault, for the spike and non-finite tests: `python tests/fault_drill.py
RANK STEP FACTOR [pretrain_gpt arguments]` multiplies global rank RANK's local gradient shards by FACTOR after the
backward of step STEP, once per process (a transient fault: a rerun of that step computes it right). FACTOR
written wN multiplies the rank's weight shards by N there instead (weights that overflow the next forwards: a
lasting fault, as an absurd learning rate would make, which the config refuses)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import pretrain_gpt  # noqa: E402


class Fault:
    def __init__(self, rank: int, step: int, factor: float, weights: bool = False):
        self.rank, self.step, self.factor, self.weights, self.fired = rank, step, factor, weights, False

    def on_gradients(self, trainer, step: int) -> None:
        if trainer.rank == self.rank and step == self.step and not self.fired:
            self.fired = True
            with torch.no_grad():
                for p in trainer.model.parameters():
                    t = p if self.weights else p.grad
                    if t is not None:
                        (t.to_local() if hasattr(t, "to_local") else t).mul_(self.factor)
            print(f"drill: rank {self.rank}: {'weights' if self.weights else 'gradients'} x {self.factor} after step "
                  f"{step}'s backward", flush=True)

    def on_step_end(self, trainer, step: int) -> None:
        pass

    def on_train_end(self, trainer) -> None:
        pass


if __name__ == "__main__":
    rank, step, factor = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    fault = Fault(rank, step, float(factor.lstrip("w")), weights=factor.startswith("w"))
    sys.exit(pretrain_gpt.cli(sys.argv[4:], hooks=[fault]))
