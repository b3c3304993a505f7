"""launch/pretrain_gpt.py with one injected fault, for the spike tests: `python tests/fault_drill.py RANK STEP
FACTOR [pretrain_gpt arguments]` multiplies global rank RANK's local gradient shards by FACTOR after the backward
of step STEP, once per process (a transient fault: a rerun of that step computes it right)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import pretrain_gpt  # noqa: E402
from hybridpar.config.cli import load_config  # noqa: E402


class Fault:
    def __init__(self, rank: int, step: int, factor: float):
        self.rank, self.step, self.factor, self.fired = rank, step, factor, False

    def on_gradients(self, trainer, step: int) -> None:
        if trainer.rank == self.rank and step == self.step and not self.fired:
            self.fired = True
            with torch.no_grad():
                for p in trainer.model.parameters():
                    if p.grad is not None:
                        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        g.mul_(self.factor)
            print(f"drill: rank {self.rank}: gradients x {self.factor} after step {step}'s backward", flush=True)

    def on_step_end(self, trainer, step: int) -> None:
        pass

    def on_train_end(self, trainer) -> None:
        pass


if __name__ == "__main__":
    rank, step, factor = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    pretrain_gpt.main(load_config(sys.argv[4:]), hooks=[Fault(rank, step, factor)])
