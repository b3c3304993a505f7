"""Each rank's piece of every parameter, read from the architecture itself: the parameter list from the model
built on the meta device, each parameter's tensor-parallel dim from the TP plan table, and the same torch.chunk
arithmetic that DTensor Shard placements and FSDP2 (dim 0 of the TP-local tensor) apply. The planner's byte counts
and the dry run's comparison both start here.

Rank coordinates follow hybridpar.parallel.distributed.Layout: the mesh is dp_replicate x dp_shard x tp, tp innermost, so
rank = (rep * dp_shard + shard) * tp + tp_rank. Rank 0 holds the largest shards (chunks are ceil-sized first).
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass, replace

from torch import nn

from hybridpar.models import ModelConfig, build_model
from hybridpar.parallel.distributed import Layout


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim TP shards (None: replicated over tp)
    block: int | None   # transformer block index (None: the root: embeddings, final norm, LM head)


def _tp_dim(style, module: nn.Module, leaf: str) -> int | None:
    """The dim a DTensor TP style shards a parameter on: column-parallel linears split their output features
    (weight dim 0, bias dim 0), row-parallel linears their input features (weight dim 1, bias replicated), and a
    row-wise embedding its vocabulary rows (dim 0). Other styles (sequence parallel, input/output preparation)
    move activations only."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(module, nn.Embedding):
        return {RowwiseParallel: 0, ColwiseParallel: 1}.get(type(style))
    if isinstance(style, ColwiseParallel):
        return 0
    if isinstance(style, RowwiseParallel):
        return 1 if leaf == "weight" else None
    return None


@functools.lru_cache(maxsize=64)  # the layout search asks for the same model's specs for every candidate
def param_specs(m: ModelConfig, layers: range | None = None) -> tuple[ParamSpec, ...]:
    """Every parameter of hybridpar's GPT (tied ones once), read from the model itself, built on the meta device,
    with the dim the TP plan (hybridpar.parallel.tensor_parallel.gpt_tp_plan) shards it on; `layers` restricts the
    blocks listed (all by default)."""
    from hybridpar.parallel.tensor_parallel import gpt_tp_plan

    n_layers = m.n_layers if layers is None else max(layers) + 1
    model = build_model(replace(m, n_layers=n_layers), device="meta", init=False)
    top, block = gpt_tp_plan(model, sequence_parallel=True)
    specs = []
    for name, p in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        index = None
        if module_name.startswith("layers."):
            _, i, inner = module_name.split(".", 2)
            index, style = int(i), block.get(inner)
            if layers is not None and index not in layers:
                continue
        else:
            style = top.get(module_name)
        specs.append(ParamSpec(name, tuple(p.shape), _tp_dim(style, model.get_submodule(module_name), leaf), index))
    return tuple(specs)


def chunk(n: int, parts: int, index: int) -> int:
    """Length of torch.chunk's piece `index` of a dim of length n split in `parts` (DTensor Shard and FSDP2 both
    split this way: ceil-sized pieces first, the last ones shorter or empty)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def local_shape(spec: ParamSpec, layout: Layout, rank: int) -> tuple[int, ...]:
    """The shape of this rank's piece: TP chunk of spec.tp_dim, then (with FSDP) the dp_shard (x cp) chunk of dim 0."""
    tp_rank = layout.coords(rank)[3]
    shape = list(spec.shape)
    if layout.tp > 1 and spec.tp_dim is not None:
        shape[spec.tp_dim] = chunk(shape[spec.tp_dim], layout.tp, tp_rank)
    if layout.dp * layout.cp > 1:  # fully_shard shards over dp_shard x cp (on a 1x1 mesh, for bf16, nothing)
        shape[0] = chunk(shape[0], layout.fsdp, layout.fsdp_index(rank))
    return tuple(shape)


def local_param_count(m: ModelConfig, layout: Layout, rank: int = 0, part: str = "all") -> tuple[int, int]:
    """(elements, tensors) of this rank's parameter shards; part = all | block (one block) | root. Every block
    has the same shapes, so one block is counted and multiplied."""
    specs = param_specs(m, layers=range(1))
    block = [numel(local_shape(s, layout, rank)) for s in specs if s.block == 0]
    root = [numel(local_shape(s, layout, rank)) for s in specs if s.block is None]
    if part == "block":
        return sum(block), len(block)
    if part == "root":
        return sum(root), len(root)
    return m.n_layers * sum(block) + sum(root), m.n_layers * len(block) + len(root)


def numel(shape) -> int:
    return math.prod(shape)


@dataclass(frozen=True)
class LocalSizes:
    """One rank's parameter sizes on a layout, in elements: computed once (local_sizes) and read by every memory and
    time term of the plan. tp_*: the tensor-parallel-local model (what FSDP gathers)."""
    params: int  # this rank's shards
    tensors: int
    hidden: tuple[tuple[tuple[int, ...], int], ...]  # Muon's matrices: (global shape, local elements), model order
    tp_params: int
    tp_block: int  # one block
    tp_root: int  # embeddings, final norm, LM head
    tp_hidden: int  # the hidden matrices (the linears fp8 converts)
    tp_head: int  # the LM head's weight
    block_matrices: int  # one block's 2-D weights, whole (what autocast caches in bf16)


@functools.lru_cache(maxsize=256)  # (every plan of a layout search asks for the same few)
def local_sizes(m: ModelConfig, layout: Layout, rank: int = 0) -> LocalSizes:
    from hybridpar.training.muon import HIDDEN_MATRIX

    tp_only, specs = Layout(1, 1, layout.tp), param_specs(m)
    hidden = [s for s in specs if HIDDEN_MATRIX.fullmatch(s.name)]
    return LocalSizes(*local_param_count(m, layout, rank),
                      tuple((s.shape, numel(local_shape(s, layout, rank))) for s in hidden),
                      local_param_count(m, tp_only, rank)[0], local_param_count(m, tp_only, rank, "block")[0],
                      local_param_count(m, tp_only, rank, "root")[0],
                      sum(numel(local_shape(s, tp_only, rank)) for s in hidden),
                      sum(numel(local_shape(s, tp_only, rank)) for s in specs if s.name == "lm_head.weight"),
                      sum(numel(s.shape) for s in specs if s.block == 0 and len(s.shape) == 2))
