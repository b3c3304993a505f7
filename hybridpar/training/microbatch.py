"""The pipeline-free microbatch scheduler: hybridpar's counterpart of Megatron's forward_backward_no_pipelining.

One optimizer step runs the rank's microbatches forward and backward in turn. Two rules make accumulation exact:
- The loss of each microbatch is its *sum* of token losses divided by the number of target tokens of the whole
  global batch (all microbatches of all data-parallel ranks), so the accumulated gradient is the gradient of the
  global batch's mean token loss, whatever the split into microbatches or ranks. Averaging per microbatch would
  weight a short-target microbatch like a full one.
- With FSDP2, `accumulate_unsharded` (hybridpar.training.reduction.MeanReduction's) chooses what is held between microbatches. True: every block stays gathered
  and its gradient unsharded until the last microbatch, which reduces once (fewest collectives, the whole
  tensor-parallel-local model held unsharded). False: each microbatch's backward reduce-scatters into the sharded
  gradient and reshards, as in a single-microbatch step; under HSDP only the cross-replica all-reduce waits for the
  last microbatch. hybridpar.planning.cost counts the memory and traffic of both.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from hybridpar.data.gpt_data import IGNORE_INDEX
from hybridpar.parallel import autocast_for
from hybridpar.parallel.distributed import local_tensor
from hybridpar.parallel.fp8 import fp8_scales
from hybridpar.training.reduction import MeanReduction


class StopMidStep(Exception):
    """Raised between microbatches when a stop was asked for and nothing would be saved: the step is abandoned."""

    def __init__(self, done: int, total: int):
        super().__init__(f"after microbatch {done} of {total}")


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the cross entropies of logits (B, T, V) against targets (B, T); IGNORE_INDEX targets count zero.
    Computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def logits_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
    """The plain path: the model's logits, then token_loss_sum (under loss_parallel for vocab-sharded logits). kw:
    the model's other arguments (context parallelism's positions)."""
    loss = token_loss_sum(model(x, **kw), y)
    router_losses = getattr(model, "moe_loss", None)  # (a GPT's; any other module: none)
    if not model.training or router_losses is None:
        return loss
    moe = router_losses()  # (a mixture of experts' router losses, training; the same value on each tp rank)
    if isinstance(loss, DTensor) and isinstance(moe, torch.Tensor):  # loss parallel's replicated loss
        moe = DTensor.from_local(moe, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim, run_check=False)
    return loss + moe


def chunked_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk_tokens: int = 4096, **kw) -> torch.Tensor:
    """The model computes the summed loss itself, LM head and cross entropy fused in chunks of tokens (no
    [tokens, vocab] logits); for unsharded vocabularies (tp = 1)."""
    return model(x, targets=y, loss_chunk_tokens=chunk_tokens, **kw)


def whole(y: torch.Tensor) -> torch.Tensor:
    return y


def count_target_tokens(microbatches: list[tuple[torch.Tensor, torch.Tensor]], mine=whole) -> torch.Tensor:
    """Target tokens of these microbatches that this rank computes the loss of (mine: its part of a (b, T)
    target tensor), as a tensor (no host read)."""
    return sum((mine(y) != IGNORE_INDEX).sum() for _, y in microbatches)


@dataclass(frozen=True)
class StepNumerics:
    """How a forward runs and its loss is taken on this layout (training and evaluation alike)."""
    autocast: Callable  # the forward's context (bf16 autocast where FSDP does not cast already)
    forward_loss: Callable  # (model, x, y) -> token-loss sum
    loss_context: Callable  # loss_parallel under tensor parallelism
    fp8_scales: Callable | None  # float8 all-gathers: the weights' scales, computed before each forward
    mine: Callable = whole  # (b, T) targets -> those whose loss this rank computes (its cp chunks; all without cp)

    @classmethod
    def of(cls, cfg, model, tp: int, device: torch.device, cp: int = 1, cp_rank: int = 0) -> "StepNumerics":
        t = cfg.train
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            loss_context, forward_loss = loss_parallel, logits_loss
        else:
            loss_context = nullcontext
            fused = t.loss_chunk_tokens and not (t.fp8 != "off" and t.fp8_linears == "all")  # (fp8 head: a module)
            forward_loss = partial(chunked_loss, chunk_tokens=t.loss_chunk_tokens) if fused else logits_loss
        mine = whole
        if cp > 1:
            from hybridpar.parallel.context import chunk_positions, context_loss
            forward_loss = context_loss(forward_loss, cp, cp_rank)

            def mine(y):
                return y[:, chunk_positions(y.shape[1], cp, cp_rank, y.device)]
        return cls(autocast_for(model, t.precision, device), forward_loss, loss_context, fp8_scales(model, cfg),
                   mine)


def forward_backward_no_pipelining(
    model: nn.Module,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    num_global_tokens: torch.Tensor,
    device: torch.device,
    forward_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = logits_loss,
    autocast=nullcontext,
    loss_context=nullcontext,
    stop_now: Callable[[], bool] = lambda: False,
    reduction=None,
) -> torch.Tensor:
    """Forward and backward over this rank's microbatches of one global batch; gradients accumulate in .grad.

    Args:
        model: the (parallelized) model, called by forward_loss.
        microbatches: this rank's (inputs, targets) pairs, each (b, T), on any device.
        num_global_tokens: target tokens of the whole global batch, all ranks together (a device tensor: no host sync).
        device: where to move each microbatch.
        forward_loss: (model, inputs, targets) -> summed token loss: logits_loss or chunked_loss.
        autocast: a context-manager factory for mixed precision (around the forward and the loss).
        loss_context: a context-manager factory around loss and backward (tensor parallelism's loss_parallel).
        stop_now: asked after each microbatch but the last; True raises StopMidStep (the step is abandoned).
        reduction: how the gradients reduce over the data-parallel ranks (hybridpar.training.reduction; default
            MeanReduction(): one reduction at the last microbatch, the loss unscaled). Its grad_scale multiplies the
            backward loss: the trainer's dp_size turns FSDP's average into the sum the global mean needs (FSDP2's
            set_gradient_divide_factor(1) reduces with PREMUL_SUM, which gloo does not have).
    Returns:
        This rank's share of the global mean token loss (a detached device tensor; summing it over data-parallel
        ranks gives the global batch's mean loss). No host sync happens here.
    """
    red = reduction if reduction is not None else MeanReduction()
    total = torch.zeros((), device=device, dtype=red.loss_dtype)
    n = len(microbatches)
    for i, (x, y) in enumerate(microbatches):
        red.sync(model, i, n)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with loss_context():
            with autocast():
                loss = forward_loss(model, x, y) / num_global_tokens
            (loss * red.grad_scale).backward()
        red.after_backward()
        total += red.loss_share(local_tensor(loss.detach()))  # (local: a replicated DTensor under loss_parallel)
        if i < n - 1 and stop_now():
            raise StopMidStep(i + 1, n)
    return total


def step_gradients(model: nn.Module, microbatches: list, numerics: StepNumerics, reduction, bounds, seed: int,
                   dp_sum: Callable, device: torch.device, stop_now: Callable[[], bool]):
    """The gradients of one optimizer step in .grad: its microbatches forward and backward under `reduction`, the
    step replayed (random numbers from `seed` again) while the reduction cannot take it on its grids (exact
    reduction, from its last step's `bounds`). Returns (this rank's loss share, the bounds for the next step)."""
    # Target tokens of the whole global batch, as a device tensor: summed over dp ranks without a host sync.
    n_tokens = dp_sum(count_target_tokens(microbatches, numerics.mine).float())
    while True:
        reduction.begin(bounds)
        loss = forward_backward_no_pipelining(model, microbatches, n_tokens, device, numerics.forward_loss,
                                              numerics.autocast, numerics.loss_context, stop_now, reduction)
        done, bounds = reduction.finish()
        if done:
            return loss, bounds
        torch.manual_seed(seed)
