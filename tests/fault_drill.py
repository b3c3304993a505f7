"""launch/pretrain_gpt.py with injected faults, for the spike and non-finite tests: `python tests/fault_drill.py
RANK STEP FACTOR [pretrain_gpt arguments]` multiplies global rank RANK's local gradient shards by FACTOR after the
backward of step STEP, once per process (a transient fault: a rerun of that step computes it right). STEP and
FACTOR may be comma-separated lists of the same length: one fault per step (e.g. `0 5,7 inf,1000`). FACTOR
written wN multiplies the rank's weight shards by N there instead (weights that overflow the next forwards: a
lasting fault, as an absurd learning rate would make, which the config refuses).

The fault goes in right after the trainer's backward: this script wraps two functions the trainer calls in a step
(the learning-rate schedule, which names the step, and the microbatch scheduler), in this process only."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import pretrain_gpt  # noqa: E402

import hybridpar.trainer  # noqa: E402
import hybridpar.training.microbatch  # noqa: E402
from hybridpar.parallel.distributed import local_tensor  # noqa: E402


def inject(rank: int, step: int, factor: float, weights: bool = False, more: dict | None = None) -> None:
    """One fault (rank, step, factor), and `more` ({step: factor}) on the same rank, each once per process."""
    lr_at, seen = hybridpar.trainer.lr_at, {"step": 0, "fired": set()}
    faults = {step: factor, **(more or {})}
    forward_backward = hybridpar.training.microbatch.forward_backward_no_pipelining

    def lr_of_step(s, *args):
        seen["step"] = s + 1  # (0-based step s trains step s + 1)
        return lr_at(s, *args)

    def faulty_step(model, *args, **kwargs):
        loss = forward_backward(model, *args, **kwargs)
        step = seen["step"]
        if dist.get_rank() == rank and step in faults and step not in seen["fired"]:
            seen["fired"].add(step)
            factor = faults[step]
            with torch.no_grad():
                for p in model.parameters():
                    t = p if weights else p.grad
                    if t is not None:
                        local_tensor(t).mul_(factor)
            print(f"drill: rank {rank}: {'weights' if weights else 'gradients'} x {factor} after step {step}'s "
                  f"backward", flush=True)
        return loss

    hybridpar.trainer.lr_at, hybridpar.training.microbatch.forward_backward_no_pipelining = lr_of_step, faulty_step


if __name__ == "__main__":
    rank, steps, factors = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3].split(",")
    weights = factors[0].startswith("w")
    faults = {int(s): float(f.lstrip("w")) for s, f in zip(steps, factors, strict=True)}
    first = min(faults)
    inject(rank, first, faults.pop(first), weights=weights, more=faults)
    sys.exit(pretrain_gpt.cli(sys.argv[4:]))
