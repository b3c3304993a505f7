"""Parallelism applied from outside the model, one function per model family.

The order is fixed: fp8 conversion -> tensor/sequence parallelism -> activation checkpointing -> torch.compile ->
FSDP.
- fp8 first (train.fp8, hybridpar/parallel/fp8.py): it swaps nn.Linear for torchao's Float8Linear, which the TP
  styles then shard and FSDP wraps (tensorwise: its weights are torchao's float8 all-gather tensors, which
  fully_shard must see when it shards them).
- TP first: it swaps parameters for DTensors sharded on the tp axis and installs the collectives; everything after
  it must see the final (local) shapes.
- Activation checkpointing wraps the TP-ed block, so recomputation replays the TP collectives too.
- compile after AC, per block: each block compiles once and is reused by every layer of the same shape. A block
  under full AC is its checkpoint wrapper, so the wrapper is what compiles: torch.compile traces the checkpoint as
  its own higher-order op (the region still recomputes in backward); selective AC wraps every block the same way,
  with its op-level policy.
- FSDP last: fully_shard must wrap the final modules, compiled or not, to place its all-gather/reduce-scatter hooks
  around them.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.config import Config
from hybridpar.errors import ConfigError
from hybridpar.parallel.fp8 import convert_fp8
from hybridpar.parallel.fsdp import apply_fsdp, check_strategy
from hybridpar.parallel.tensor_parallel import apply_tp


def check_layout(cfg: Config, degrees: tuple[int, int, int], gpus_per_node: int | None) -> None:
    """Every divisibility rule of the layout, with all the factors in the message; hybridpar.resolve runs it with
    the final vocabulary, before any model exists."""
    dp_replicate, dp_shard, tp = degrees
    m = cfg.model
    if tp > 1:
        bad = {name: v for name, v in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads),
                                       ("model.ffn_dim", m.ffn_dim)) if v % tp}
        if cfg.parallel.sequence_parallel and cfg.train.seq_len % tp:
            bad["train.seq_len (sequence parallel)"] = cfg.train.seq_len
        if bad:
            raise ConfigError(f"parallel.tp={tp} must divide " + ", ".join(f"{k}={v}" for k, v in bad.items())
                             + "; pick tp among their common divisors")
        if gpus_per_node is not None and tp > gpus_per_node:
            raise ConfigError(f"parallel.tp={tp} exceeds the {gpus_per_node} GPUs of a node; TP needs the fast "
                             f"links inside a node: use tp <= {gpus_per_node} and grow dp_shard instead")
    check_strategy(cfg.parallel, dp_shard)


def autocast_for(model: nn.Module, precision: str, device: torch.device):
    """The context a forward runs in: bf16 autocast where FSDP's MixedPrecisionPolicy does not cast already."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import FSDPModule

    if precision == "bf16" and not isinstance(model, FSDPModule):
        return functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    return nullcontext


def uses_fsdp(cfg: Config, dp: int) -> bool:
    """fully_shard wraps the model when there is data parallelism, and for bf16 on any mesh (1x1 included): its
    MixedPrecisionPolicy gives bf16 compute with fp32 master weights and fp32 gradient reduction, so one GPU and
    many run the same numerics (autocast would keep an fp32 residual stream, save one bf16 copy of a norm's output
    per projection and cache bf16 copies of every weight until backward)."""
    return dp > 1 or cfg.train.precision == "bf16"


@functools.cache
def _saved_by_selective() -> frozenset:
    """Ops whose outputs selective checkpointing keeps: the matmuls, fused attention (output and log-sum-exp) and
    the reduce-scatter / all-reduce that end a TP region. Everything else in a block (norms, RoPE, the MLP's
    activation, residual adds, dropout, the sequence-parallel all-gathers) is recomputed in backward."""
    ops = []
    for ns, name in [("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"),
                     ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
                     ("aten", "_scaled_dot_product_flash_attention"),
                     ("aten", "_scaled_dot_product_efficient_attention"),
                     ("aten", "_scaled_dot_product_cudnn_attention"), ("_c10d_functional", "reduce_scatter_tensor"),
                     ("_c10d_functional", "all_reduce")]:
        packet = getattr(getattr(torch.ops, ns), name, None)
        if packet is not None:
            ops.append(packet.default)
    return frozenset(ops)


def selective_contexts():
    """The context pair of one selectively checkpointed forward (torch.utils.checkpoint's op-level policy)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _saved_by_selective()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1, preserve_rng: bool = False) -> None:
    """none: keep every activation. full: recompute whole blocks 0, every, 2*every, ... in backward (a block keeps
    only its input). selective: every block keeps its input and the outputs of its matmuls and fused attention, and
    recomputes the cheap rest in backward (norms, RoPE, the MLP's activation, residual adds; under sequence
    parallelism also the all-gathers, so a block keeps the sequence shard as Megatron-LM does): no matmul FLOPs are
    recomputed. Wraps in place; parameter names are unchanged in checkpoints (DCP's state-dict helpers strip the
    wrapper's prefix)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        if mode == "full" and i % every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=preserve_rng)
        elif mode == "selective":
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=preserve_rng,
                                                 context_fn=selective_contexts)


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Apply hybridpar's parallelism and memory/speed wrappers to a GPT on the meta device, in place (each rank then
    materialises only its shards: hybridpar.parallel.startup)."""
    tp, dp = mesh["tp"].size(), mesh["dp_replicate"].size() * mesh["dp_shard"].size()
    if cfg.train.fp8 != "off":
        convert_fp8(model, cfg, emulate=mesh.device_type != "cuda", fsdp=uses_fsdp(cfg, dp))
    if tp > 1:
        # Blocks keep sequence shards through saved-tensor hooks, which checkpointing (its own hooks) and compile
        # would not see through: only without either.
        plain = cfg.train.activation_checkpointing == "none" and not cfg.train.compile
        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, keep_shards_in_blocks=plain)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.ac_every,
                                   preserve_rng=cfg.model.dropout > 0)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    if uses_fsdp(cfg, dp):
        apply_fsdp(model, mesh, cfg.parallel, bf16=cfg.train.precision == "bf16")
    return model


def start_notes(cfg: Config, device: torch.device) -> list[str]:
    """What a run should know at start about its numerics on this device, once (the trainer prints them)."""
    m, t, notes = cfg.model, cfg.train, []
    if t.fp8 != "off":
        notes.append(f"note: fp8 ({t.fp8}) on {t.fp8_linears} linears" + (
            "" if device.type == "cuda" else f", emulated on {device.type} (float8 casts and scales, high-precision "
                                             f"GEMMs: the GPU's code path, not its speed)"))
    if device.type != "cuda" or t.precision != "fp32":
        return notes
    notes.append("note: fp32 matmuls are strict fp32 (TF32 off)" if not t.tf32 else
                 "note: fp32 matmuls use TF32 tensor cores (train.tf32)")
    if not t.tf32:
        notes.append("      --train.tf32 true runs them on TF32 tensor cores, several times faster")
    if m.kv_heads < m.n_heads:
        notes.append(f"note: fp32 grouped-query attention ({m.n_heads} query / {m.kv_heads} key-value heads) runs "
                     f"CUDA's math attention kernel, which keeps B x heads x T^2 scores for backward (the planner "
                     f"counts them); bf16 uses the fused kernels")
    return notes
