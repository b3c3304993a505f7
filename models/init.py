"""Random initialisation that does not depend on how a tensor is split.

Every entry of a parameter drawn N(0, std) is a function of (seed, parameter name, global position) alone: the
tensor, seen as a matrix (rows = dim 0, columns = the other dims; a vector is one row), is cut into fixed tiles of
TILE_ROWS x TILE_COLS (fewer for a narrower tensor); each tile's values come from its own generator, seeded by a hash of (seed, name, tile row,
tile column), on the CPU. Whoever holds any rectangle of the matrix (all of it in one process, a row or column
shard of it under TP or FSDP) draws only the tiles that overlap its rectangle and gets exactly the entries the
whole tensor would have there. So the same seed gives bitwise the same global weights for every layout and device
count, and a rank's init time grows with its shard, not with the model. Values are the same on CPU and GPU (drawn
on the CPU, then copied).
"""

from __future__ import annotations

import hashlib
import math

import torch

TILE_ROWS, TILE_COLS = 16, 1024  # 16K entries a tile: ~60 us to draw on one CPU core


def _tile_seed(seed: int, key: str, row: int, col: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{key}:{row}:{col}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _as_matrix(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@torch.no_grad()
def keyed_normal_(out: torch.Tensor, std: float, seed: int, key: str, global_shape: tuple[int, ...] | None = None,
                  offset: tuple[int, ...] | None = None) -> torch.Tensor:
    """Fill `out`, the block of a tensor of `global_shape` (default: out's own) that starts at `offset` (default:
    the origin), with that tensor's N(0, std) entries keyed by (seed, key). For tensors of more than 2 dims only
    dim 0 may be split. Returns out."""
    global_shape = tuple(global_shape if global_shape is not None else out.shape)
    offset = tuple(offset if offset is not None else (0,) * len(global_shape))
    if out.numel() == 0:
        return out
    if len(global_shape) > 2 and (tuple(out.shape[1:]) != global_shape[1:] or any(offset[1:])):
        raise ValueError(f"{key}: keyed init splits dim 0 only for {len(global_shape)}-D tensors")
    if len(global_shape) == 1:
        (r0, c0), (h, w) = (0, offset[0]), (1, out.shape[0])
    else:
        (r0, c0), (h, w) = (offset[0], offset[1] if len(offset) > 1 else 0), _as_matrix(tuple(out.shape))
    R, C = _as_matrix(global_shape)
    th, tw = min(TILE_ROWS, R), min(TILE_COLS, C)  # tiles fit narrow tensors (a function of the global shape only)
    block = torch.empty(h, w, dtype=torch.float32)  # (h, w), on the CPU: the transient is one shard of one tensor
    gen = torch.Generator()
    for tr in range(r0 // th, (r0 + h - 1) // th + 1):
        for tc in range(c0 // tw, (c0 + w - 1) // tw + 1):
            gen.manual_seed(_tile_seed(seed, key, tr, tc))
            tile = torch.randn(th, tw, generator=gen)  # (th, tw)
            rs, re = max(r0, tr * th), min(r0 + h, (tr + 1) * th)  # global rows in both the tile and the block
            cs, ce = max(c0, tc * tw), min(c0 + w, (tc + 1) * tw)
            block[rs - r0:re - r0, cs - c0:ce - c0] = tile[rs - tr * th:re - tr * th, cs - tc * tw:ce - tc * tw]
    out.copy_(block.mul_(std).view(out.shape))
    return out
