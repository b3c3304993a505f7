"""Parallelism applied from outside the model, one function per model family.

The order is fixed: tensor/sequence parallelism -> activation checkpointing -> torch.compile -> FSDP.
- TP first: it swaps parameters for DTensors sharded on the tp axis and installs the collectives; everything after
  it must see the final (local) shapes.
- Activation checkpointing wraps the TP-ed block, so recomputation replays the TP collectives too.
- compile after AC, per block: each block compiles once and is reused by every layer of the same shape, and the
  checkpoint boundary stays outside the compiled region.
- FSDP last: fully_shard must wrap the final modules, compiled or not, to place its all-gather/reduce-scatter hooks
  around them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.config import Config


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Apply hybridpar's parallelism and memory/speed wrappers to a GPT from hybridpar.models, in place."""
    tp, dp = mesh["tp"].size(), mesh["dp_replicate"].size() * mesh["dp_shard"].size()
    if tp > 1 or dp > 1:
        raise ValueError(f"this build of hybridpar trains on one process (mesh tp={tp}, data-parallel {dp}); "
                         f"launch without torchrun or with --nproc_per_node 1")
    if cfg.train.activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=cfg.model.dropout > 0)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    return model
