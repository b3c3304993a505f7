"""Context parallelism (parallel.cp): each sequence split over the cp ranks of a data-parallel rank.

Load-balanced causal sharding: a sequence of T tokens is cut into 2 cp chunks of T / (2 cp); cp rank i holds chunks
i and 2cp - 1 - i, so every rank has the same causal attention work (an early chunk sees few keys, a late one many).
Every token-wise part of the model (embeddings, norms, MLPs, the LM head and the loss) runs on a rank's own tokens;
attention all-gathers keys and values over the cp group (grouped-query attention keeps them small), each query attends
to the keys at or before its position, and backward reduce-scatters the keys' and values' gradients. The positions of
a rank's tokens (RoPE's angles, learned position embeddings) are their places in the whole sequence.

The loss of a rank is the summed cross entropy of its tokens; divided by the global batch's target tokens, summed over
data-parallel and cp ranks (hybridpar.parallel.distributed.dp_sum) it is the global mean, the same number as one
process's; FSDP shards over dp_shard x cp, so each gradient is reduced over them (its average, which the loss scale
turns back into the sum).

Attention runs as one scaled_dot_product_attention of the rank's queries over the gathered keys with a boolean mask
(key position <= query position): on the CPU and for every SDPA backend that takes a mask. A flash kernel takes no
mask, so a GPU run uses the memory-efficient or math kernel here (not measured on a GPU yet).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.errors import ConfigError


def chunk_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions (int64, seq_len / cp of them, ascending) of cp rank `rank`'s tokens: chunks rank and
    2cp - 1 - rank of 2cp."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c, device=device),
                      torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)])


# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (2 of (B, n, T, hd)) over a group; backward reduce-scatters the gradient
    (each rank's queries contribute to every rank's keys)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        local = x.movedim(2, 0).contiguous()  # (T, B, n, hd): the gather concatenates along dim 0
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather(out, local, group=group)
        return out.movedim(0, 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        whole = grad.movedim(2, 0).contiguous()
        out = whole.new_empty((whole.shape[0] // ctx.size, *whole.shape[1:]))
        _reduce_scatter(out, whole, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, 2), None, None


class KeysFromEveryChunk:
    """An attention layer's context (models/gpt.py Attention.context): its keys and values gathered from every cp
    rank, and the causal mask of this rank's queries over them."""

    def __init__(self, group, cp: int):
        self.group, self.cp = group, cp
        self._mask = (None, None)  # (positions, their mask): every layer of a forward gets the same positions

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """(T / cp, T) bool: True where a query of this rank may see a key of the gathered sequence; one tensor for
        every layer of a forward (and so one saved for backward)."""
        if self._mask[0] is not positions:
            seq_len = positions.numel() * self.cp
            keys = torch.cat([chunk_positions(seq_len, self.cp, r, positions.device) for r in range(self.cp)])
            self._mask = (positions, keys[None, :] <= positions[:, None])
        return self._mask[1]

    def __call__(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        return (_GatherSequence.apply(k, self.group, self.cp), _GatherSequence.apply(v, self.group, self.cp),
                self.mask(positions))


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Give every attention layer the context of the cp axis (one, shared), in place (no parameter changes)."""
    context = KeysFromEveryChunk(cp_mesh.get_group(), cp_mesh.size())
    for block in model.layers:  # (before activation checkpointing wraps the blocks)
        block.attn.context = context


def context_loss(forward_loss, cp: int, rank: int):
    """forward_loss (model, x, y, **kw) -> summed token loss, on this cp rank's chunks of every sequence, with their
    positions."""
    def loss(model, x, y, **kw):
        positions = chunk_positions(x.shape[1], cp, rank, x.device)
        return forward_loss(model, x[:, positions], y[:, positions], positions=positions, **kw)
    return loss


def check_cp(cfg, tp: int, gpus_per_node: int | None, seq_lens: list[int]) -> None:
    """parallel.cp's rules, one line each: every sequence length a multiple of 2 cp (tp too under sequence
    parallelism, of each rank's share), cp x tp inside a node, and what context parallelism does not run with yet."""
    cp = cfg.parallel.cp
    if cp == 1:
        return
    for seq in seq_lens:
        if seq % (2 * cp):
            raise ConfigError(f"parallel.cp={cp} splits each sequence into 2 x cp = {2 * cp} chunks: train.seq_len="
                              f"{seq} is not a multiple of {2 * cp}; use a sequence length divisible by it")
        if tp > 1 and cfg.parallel.sequence_parallel and (seq // cp) % tp:
            raise ConfigError(f"parallel.cp={cp} x tp={tp} with sequence parallelism: each cp rank's {seq // cp} "
                              f"tokens must divide by tp; use a sequence length divisible by {cp * tp * 2}")
    if gpus_per_node is not None and cp * tp > gpus_per_node:
        raise ConfigError(f"parallel.cp={cp} x tp={tp} exceeds the {gpus_per_node} GPUs of a node: the keys' and "
                          f"values' all-gathers need the node's links; lower cp or tp")
    t = cfg.train
    refused = {"train.compile": t.compile, f"train.fp8={t.fp8}": t.fp8 != "off",
               "parallel.exact_reduction": cfg.parallel.exact_reduction, "optim.name=muon": cfg.optim.name == "muon",
               "train.eval_tasks": bool(t.eval_tasks), f"model.dropout={cfg.model.dropout}": cfg.model.dropout > 0,
               "parallel.layout auto": cfg.parallel.layout == "auto"}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ConfigError(f"parallel.cp={cp} does not run with {', '.join(bad)} yet; use parallel.cp 1 for it")
