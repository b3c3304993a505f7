"""FSDP2 (`fully_shard`) over the data-parallel axes: per transformer block, then the root.

The data-parallel mesh is (dp_replicate, dp_shard): with dp_replicate > 1 that is HSDP (parameters sharded within a
dp_shard group, replicated across groups; gradients reduce-scattered within, all-reduced across); with dp_shard = 1
it is plain data parallelism (nothing sharded, gradients all-reduced). parallel.fsdp_strategy picks that layout
(hybrid_shard, no_shard; hybridpar.parallel.distributed.resolve_degrees) and when parameters are resharded:
full_shard after each block's forward (all-gathered again for backward), shard_grad_op not until backward (more
memory, one all-gather less), N to groups of N ranks.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from hybridpar.config import ParallelConfig
from hybridpar.errors import ConfigError


def dp_mesh_of(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP's mesh: the shard axis dp_shard (dp_shard x cp, flattened by init_mesh, under context parallelism: the
    cp ranks hold the same parameters), under HSDP with dp_replicate before it."""
    shard = "dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"
    with warnings.catch_warnings():  # (torch 2.13 warns that slicing a flattened axis from the root will change;
        warnings.simplefilter("ignore", UserWarning)  # FSDP over it with TP needs the root's slice today)
        return mesh["dp_replicate", shard] if mesh["dp_replicate"].size() > 1 else mesh[shard]


def check_strategy(cfg: ParallelConfig, dp_shard: int) -> None:
    n = cfg.fsdp_strategy
    if isinstance(n, int) and (n >= dp_shard or dp_shard % n):
        raise ConfigError(f"parallel.fsdp_strategy={n} must divide parallel.dp_shard={dp_shard} and lie strictly "
                          f"between 1 and it (the GPUs of a node / tp, typically), or be full_shard, shard_grad_op, "
                          f"hybrid_shard or no_shard")


def reshard_after_forward(cfg: ParallelConfig) -> bool | int:
    """What each block keeps after its forward: True (resharded), False (gathered: shard_grad_op) or N (resharded
    over groups of N ranks)."""
    return cfg.fsdp_strategy if isinstance(cfg.fsdp_strategy, int) else cfg.fsdp_strategy != "shard_grad_op"


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, bf16: bool,
               expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """fully_shard each block, then the root (embeddings, final norm, LM head), in place.

    Prefetch: FSDP2 by itself issues the all-gather of the next block when the current one starts (forward) or
    finishes (backward). parallel.fsdp_prefetch = k > 1 lists the next k blocks explicitly, so k all-gathers are
    in flight ahead of compute (more overlap on slow links, k blocks' unsharded parameters held at once).
    A mixture of experts' units (hybridpar.parallel.experts.apply_moe_fsdp) are wrapped first, on expert_mesh.
    """
    dp_mesh = dp_mesh_of(mesh)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                              reduce_dtype=torch.float32 if bf16 else None)
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cfg.fsdp_cpu_offload else OffloadPolicy()
    reshard = reshard_after_forward(cfg)
    blocks = list(model.layers)
    if expert_mesh is not None:
        from hybridpar.parallel.experts import apply_moe_fsdp

        dense_dp = dp_mesh.size()
        apply_moe_fsdp(model, mesh, expert_mesh, dense_dp, mp_policy=mp, offload_policy=offload,
                       reshard_after_forward=reshard)
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    # The root's parameters are needed again right after forward (LM head -> loss -> backward): keep them.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=False)
    k = cfg.fsdp_prefetch
    if k > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + k])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - k):i][::-1])
    return model
