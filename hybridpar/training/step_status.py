"""What the trainer reads back of each step: the gradient norm, the ranks' stop votes and (when spikes are tested) the
global loss, one small device tensor per step, read on the host now or one step late (hybridpar.trainer), with this
rank's own (loss share, gradient-shard norm^2) when spike.rerun keeps them. The queue only reads; the trainer acts."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


@dataclass(frozen=True)
class StepReading:
    step: int  # 1-based: the step whose status this is
    grad_norm: float
    stop_voted: bool  # some rank was asked to stop
    loss: float | None  # the global loss, when spikes are tested
    local: tuple[float, float] | None  # this rank's (loss share, gradient-shard norm^2), with spike.rerun


class StatusQueue:
    """Step statuses not yet read on the host, oldest first."""

    def __init__(self):
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []

    def push(self, step: int, status: torch.Tensor, local: torch.Tensor | None = None) -> None:
        self._pending.append((step, status, local))

    def read(self, keep_last: bool = False) -> list[StepReading]:
        """The pending steps' readings, oldest first; keep_last leaves the newest step pending (its kernels may still
        run, and reading it would wait for them)."""
        out = []
        while len(self._pending) > (1 if keep_last else 0):
            step, status, local = self._pending.pop(0)
            norm, stop, *loss = status.tolist()
            out.append(StepReading(step, norm, bool(stop), loss[0] if loss else None,
                                   None if local is None else tuple(local.tolist())))
        return out
