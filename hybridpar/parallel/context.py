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

Attention, per layer: the gathered keys and values are put in sequence order, and each of the rank's two query
chunks (chunk g: c = T / (2 cp) queries at positions g c .. (g + 1) c - 1) attends to the keys before its end,
K[:(g + 1) c], under a (c, (g + 1) c) additive mask (query i sees keys up to g c + i): one
scaled_dot_product_attention per chunk, which on a GPU runs the fused memory-efficient kernel (it takes a mask; flash
takes none). The work of the two chunks, (g + 1) + (2 cp - g) = 2 cp + 1 chunk blocks, is the same on every rank:
(2 cp + 1) / (4 cp) of the rank's dense share of the T x T scores, against 1/2 for a causal kernel without cp. The
keys and values a rank keeps for backward are those of the whole sequence: 2 x T x n_kv_heads x head_dim elements per
sequence and layer (what the planner counts), against 2 x T / cp x n_kv_heads x head_dim without the gather.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
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


def sequence_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """The index putting the all-gathered tokens (rank 0's chunks, rank 1's, ...) in sequence order."""
    gathered = torch.cat([chunk_positions(seq_len, cp, r) for r in range(cp)])
    return gathered.argsort().to(device)


class ChunkAttention:
    """An attention layer's context under context parallelism (models/gpt.py Attention.context): causal attention
    of this rank's query chunks over the keys and values of the whole sequence, gathered from every cp rank."""

    def __init__(self, group, cp: int, rank: int):
        self.group, self.cp, self.rank = group, cp, rank
        self._cache: dict[tuple, tuple] = {}  # (chunk length, device, dtype) -> (sequence_order, the chunks' masks)

    def _order_and_masks(self, c: int, q: torch.Tensor) -> tuple:
        """The gathered tokens' sequence order, and for each query chunk g the (c, (g + 1) c) additive mask of the
        keys its queries see (0 where key j <= g c + i, else -inf: causal, aligned to the lower right), in the
        queries' dtype: SDPA would convert a boolean mask to it on every call, and keep each layer's copy for
        backward; this one tensor serves every layer."""
        key = (c, q.device, q.dtype)
        if key not in self._cache:
            masks = []
            for g in (self.rank, 2 * self.cp - 1 - self.rank):
                keys, queries = torch.arange((g + 1) * c, device=q.device), g * c + torch.arange(c, device=q.device)
                hidden = keys[None, :] > queries[:, None]
                masks.append(torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, -math.inf))
            self._cache[key] = (sequence_order(2 * c * self.cp, self.cp, q.device), masks)
        return self._cache[key]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """q (B, nh, T / cp, hd), k and v (B, nkv, T / cp, hd) of this rank's chunks -> the attention output
        (B, nh, T / cp, hd)."""
        c = q.shape[2] // 2
        order, masks = self._order_and_masks(c, q)
        k, v = (_GatherSequence.apply(t, self.group, self.cp).index_select(2, order) for t in (k, v))
        out = []
        for i, mask in enumerate(masks):
            end = mask.shape[1]
            out.append(F.scaled_dot_product_attention(
                q[:, :, i * c:(i + 1) * c], k[:, :, :end], v[:, :, :end], attn_mask=mask, dropout_p=dropout_p,
                enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(out, dim=2)


def apply_cp(model: nn.Module, cp_mesh) -> None:
    """Give every attention layer the context of the cp axis (one, shared), in place (no parameter changes)."""
    context = ChunkAttention(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
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
    refused = {"train.compile": cfg.train.compile, "parallel.layout auto": cfg.parallel.layout == "auto"}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ConfigError(f"parallel.cp={cp} does not run with {', '.join(bad)} yet; use parallel.cp 1 for it")
