"""How a step's gradients are reduced over the data-parallel ranks: one interface, two implementations.

MeanReduction is the default: FSDP2 reduces (averages over the data-parallel ranks, which the loss scale turns back
into the global batch's sum) at the last microbatch, or after each one (parallel.accumulate_unsharded=False).
hybridpar.parallel.exact.ExactGradients (parallel.exact_reduction) sums every global microbatch's gradient as
integers, the same bits on every data-parallel layout. The microbatch scheduler and the trainer call, per step:

    begin(bounds)                 the step (or its replay) starts; bounds: the state's grids (None without them)
    sync(model, i, n)             before microbatch i of n: the FSDP flags for what reduces after its backward
    grad_scale                    the factor on each microbatch's loss before its backward
    after_backward()              after each backward
    loss_share(share)             a microbatch's loss share, as it is summed (loss_dtype)
    finish() -> (done, bounds)    after the last microbatch: done False replays the step; bounds go to the state
    grad_norm                     None (the optimizer's norm), or model -> the global gradient norm
    row()                         what the metrics row reports of it
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule


class MeanReduction:
    loss_dtype = torch.float32
    grad_norm = None

    def __init__(self, grad_scale: float = 1.0, accumulate_unsharded: bool = True):
        self.grad_scale, self.accumulate_unsharded = grad_scale, accumulate_unsharded

    def begin(self, bounds: list[float] | None) -> None:
        self.bounds = bounds  # (none of its own: the state's are kept as they are)

    def sync(self, model, i: int, n: int) -> None:
        if not hasattr(model, "set_requires_gradient_sync") or n == 1:  # (not FSDP2, or one microbatch: reduce)
            return
        last = i == n - 1
        if self.accumulate_unsharded:  # no reduce-scatter / all-reduce before the last, no re-gather in between
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
        else:  # reduce-scatter every microbatch; HSDP's cross-replica all-reduce on the last only
            model.set_requires_all_reduce(last)

    def after_backward(self) -> None:
        pass

    @staticmethod
    def loss_share(share: torch.Tensor) -> torch.Tensor:
        return share

    def finish(self) -> tuple[bool, list[float] | None]:
        return True, self.bounds

    def row(self) -> dict:
        return {}


def build_reduction(cfg, model, mesh, dp_size: int):
    """The run's reduction. FSDP averages over the dp ranks; the loss wants the sum, hence the scale of dp_size."""
    if cfg.parallel.exact_reduction:  # (its module imports torch-private FSDP classes: only when chosen)
        from hybridpar.parallel.exact import ExactGradients
        from hybridpar.parallel.startup import plain_name

        # the grids are keyed by each parameter's plain name, the same on every layout
        return ExactGradients(model, mesh, {id(p): plain_name(n) for n, p in model.named_parameters()})
    return MeanReduction(float(dp_size) if isinstance(model, FSDPModule) else 1.0, cfg.parallel.accumulate_unsharded)
