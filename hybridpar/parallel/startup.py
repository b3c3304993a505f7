"""The one start-up path of a model (the trainer, the benchmark and the planner's dry run all use it).

1. The model is built on the meta device: shapes only, no memory.
2. It is parallelised there, in the fixed order (fp8 -> TP -> activation checkpointing -> compile -> FSDP): parameters
   become DTensors that know their global shape and which part of it this rank holds.
3. Each rank allocates only its own shards (`to_empty`) and initialises them: constants directly, random entries
   with models/init.py's keyed tiles, which give every global position the same value whatever the layout.

Memory bound: a rank holds its shards plus, transiently, one tensor's local shard in host memory (the staging
buffer of models.init.keyed_normal_) and one tile (16 x 1024 fp32). Nothing full-size is ever built.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridpar.config import Config
from hybridpar.models import build_model
from hybridpar.models.init import keyed_normal_
from hybridpar.parallel import parallelize_gpt
from hybridpar.parallel.distributed import local_tensor

# Module-name parts that wrappers insert (activation checkpointing, torch.compile): not part of a parameter's name.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def plain_name(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


@torch.no_grad()
def init_sharded_(model: nn.Module, seed: int) -> None:
    """Initialise every parameter's local part (a DTensor's shard, or a whole plain tensor) as the unsharded model's
    init_weights(seed) would have at those global positions, then the buffers."""
    table = {plain_name(n): v for n, v in model.init_table().items()}
    for name, p in model.named_parameters():
        name = plain_name(name)
        kind, std = table[name]
        local = local_tensor(p)
        if kind != "normal":
            local.fill_(1.0 if kind == "ones" else 0.0)
            continue
        offset = None
        if isinstance(p, DTensor):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            assert tuple(shape) == tuple(local.shape), (name, shape, local.shape)
        keyed_normal_(local, std, seed, name, tuple(p.shape), offset)
    model.init_buffers()


def build_parallel_model(cfg: Config, mesh: DeviceMesh, device: torch.device, init: bool = True,
                         report: Callable[[str], None] = lambda _: None) -> nn.Module:
    """cfg's model, parallelised over `mesh` on the meta device, then only this rank's shards materialised on
    `device` and (with init) initialised from cfg.train.seed, layout-invariantly. report(line) hears each phase
    with its time as it ends."""
    t0 = time.perf_counter()
    model = build_model(cfg.model, device="meta")
    if cfg.optim.master_dtype == "bf16":  # the weights themselves in bf16 (the buffers, RoPE's tables, stay fp32)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    t1 = time.perf_counter()
    model = parallelize_gpt(model, mesh, cfg)
    t2 = time.perf_counter()
    report(f"start-up: model built on the meta device in {t1 - t0:.2f}s, parallelised (fp8/TP/AC/compile/FSDP "
           f"wrappers) in {t2 - t1:.2f}s")
    model.to_empty(device=device)
    if cfg.model.tie_embeddings and model.lm_head.weight is not model.tok_embeddings.weight:
        model.tie_weights()  # to_empty of an unwrapped module makes new Parameters (FSDP2's swap keeps them tied)
    if init:
        init_sharded_(model, cfg.train.seed)
    else:
        model.init_buffers()
    report(f"start-up: this rank's shards materialised on {device}" + (" and initialised" if init else "")
           + f" in {time.perf_counter() - t2:.2f}s")
    return model
