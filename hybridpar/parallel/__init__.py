"""Parallelism applied from outside the model, one function per model family (parallelize_gpt, here).

Its modules: the process group, mesh and layout (distributed.py), fp8 conversion (fp8.py), the TP plan
(tensor_parallel.py) and SP's sequence shards (sequence_shard.py), FSDP2 wrapping (fsdp.py), the meta-device start-up
(startup.py), and exact reduction's integer gradient sums (exact.py, imported only when the mode is on).

The order is fixed: fp8 conversion -> tensor/sequence parallelism -> context parallelism -> activation
checkpointing -> torch.compile -> FSDP.
- fp8 first (train.fp8, hybridpar/parallel/fp8.py): it swaps nn.Linear for torchao's Float8Linear, which the TP
  styles then shard and FSDP wraps (tensorwise: its weights are torchao's float8 all-gather tensors, which
  fully_shard must see when it shards them).
- TP next: it swaps parameters for DTensors sharded on the tp axis and installs the collectives; everything after
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
import os

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar import MKL_REPRODUCIBLE
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
    per projection and cache bf16 copies of every weight until backward). A mixture of experts under tp needs it
    too: its tp ranks hold different tokens, and its FSDP units sum their gradients over them."""
    return dp > 1 or cfg.train.precision == "bf16" or (cfg.model.n_experts > 0 and cfg.parallel.tp > 1)


def _ops(*names: tuple[str, str]) -> frozenset:
    """The default overloads of the named ops that this torch build has."""
    packets = (getattr(getattr(torch.ops, ns), name, None) for ns, name in names)
    return frozenset(p.default for p in packets if p is not None)


@functools.cache
def _selective_ops() -> tuple[frozenset, frozenset]:
    """(linear, kept): the ops of a linear layer (a matmul, fp8's scaled matmul) and the other ops whose outputs
    selective checkpointing keeps (fused attention's output and log-sum-exp; the math kernel's batched matmuls)."""
    linear = _ops(("aten", "mm"), ("aten", "addmm"), ("aten", "_scaled_mm"))
    kept = _ops(("aten", "bmm"), ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
                ("aten", "_scaled_dot_product_flash_attention"), ("aten", "_scaled_dot_product_efficient_attention"),
                ("aten", "_scaled_dot_product_cudnn_attention"))
    return linear, kept


def selective_contexts(n_linears: int):
    """The context pair of one selectively checkpointed residual branch (torch.utils.checkpoint's op-level
    policy) whose `n_linears` linear layers run in this order: the outputs of all but the last and of the attention
    kernel are kept, everything else is recomputed in backward (the norm, RoPE, the MLP's activation, the
    sequence-parallel all-gather). The last linear (the output or down projection, row-parallel under TP) is
    neither kept nor recomputed: backward needs its input, not its output, and recomputation stops once it has
    what backward needs, so its full-width partial sums and the reduce-scatter after them are never held."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    linear, kept = _selective_ops()
    met = {False: 0, True: 0}  # linear ops met in the forward and in the recomputation of this call

    def policy(ctx, op, *args, **kwargs):
        if op in linear:
            met[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if met[ctx.is_recompute] < n_linears else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(fn, n_linears: int, preserve_rng: bool):
    """fn, selectively checkpointed (selective_contexts) on every call."""
    from torch.utils.checkpoint import checkpoint

    @functools.wraps(fn)
    def run(*args):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng,
                          context_fn=run.context_fn)
    run.context_fn = functools.partial(selective_contexts, n_linears)  # (read at each call: dry_run records it)
    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1, preserve_rng: bool = False) -> None:
    """none: keep every activation. full: recompute whole blocks 0, every, 2*every, ... in backward (a block keeps
    only its input). selective: each residual branch of every block (norm + attention, norm + MLP) is checkpointed
    on its own and keeps its input, the outputs of its linears but the last and of the attention kernel; backward
    recomputes the cheap rest (norms, RoPE, the MLP's activation; under sequence parallelism the all-gathers, so a
    branch keeps the sequence shard as Megatron-LM does) and no matmul. Wraps in place; parameter names are
    unchanged in checkpoints (full: DCP's state-dict helpers strip the wrapper's prefix; selective wraps the
    blocks' branch methods, not modules)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.layers):
        if mode == "full" and i % every == 0:
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=preserve_rng)
        elif mode == "selective":
            # torchao's float8 linears: recomputation would run past the last one and redo its matmul, so under
            # train.fp8 every linear's output is kept (the planner counts the two projections' outputs)
            keep_last = int(any(type(m).__name__ == "Float8Linear" for m in block.modules()))
            mlp_linears = 3 if getattr(block.mlp, "swiglu", False) else 2
            block.attn_branch = _checkpointed(block.attn_branch, 4 + keep_last, preserve_rng)  # q, k, v, output
            block.mlp_branch = _checkpointed(block.mlp_branch, mlp_linears + keep_last, preserve_rng)  # (gate,) up, down


def parallelize_gpt(model: nn.Module, mesh: DeviceMesh, cfg: Config) -> nn.Module:
    """Apply hybridpar's parallelism and memory/speed wrappers to a GPT on the meta device, in place (each rank then
    materialises only its shards: hybridpar.parallel.startup)."""
    # (the cp ranks of a data-parallel rank share its parameters: FSDP shards and reduces over them like dp_shard)
    tp, dp = mesh["tp"].size(), mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["cp"].size()
    if cfg.train.fp8 != "off":
        convert_fp8(model, cfg, emulate=mesh.device_type != "cuda", fsdp=uses_fsdp(cfg, dp))
    if tp > 1:
        # Blocks keep sequence shards through saved-tensor hooks, which checkpointing (its own hooks) and compile
        # would not see through: only without either.
        plain = cfg.train.activation_checkpointing == "none" and not cfg.train.compile
        apply_tp(model, mesh["tp"], cfg.parallel.sequence_parallel, keep_shards_in_blocks=plain)
    emesh = None
    if cfg.model.n_experts:  # tp token shards, sequence statistics over cp x tp, experts over ep groups
        from hybridpar.parallel.experts import apply_moe
        emesh = apply_moe(model, mesh, cfg.parallel.ep, cfg.parallel.sequence_parallel)
    if mesh["cp"].size() > 1:  # attention's keys and values from every cp rank's chunks
        from hybridpar.parallel.context import apply_cp
        apply_cp(model, mesh["cp"])
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing, cfg.train.ac_every,
                                   preserve_rng=cfg.model.dropout > 0)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    # (parallel.exact_reduction over replicas alone, in fp32: plain data parallelism, which the mode reduces itself;
    # FSDP would sum the replicas' gradients in float without a reduce-scatter to quantize them in)
    replicas_only = (cfg.parallel.exact_reduction and mesh["dp_shard"].size() * mesh["cp"].size() == 1
                     and cfg.train.precision != "bf16")
    if uses_fsdp(cfg, dp) and not replicas_only:
        apply_fsdp(model, mesh, cfg.parallel, bf16=cfg.train.precision == "bf16", expert_mesh=emesh)
    return model


def cpu_blas_notes(mkl: bool, env) -> list[str]:
    """Whether this CPU run's matmuls give the same bits in every fresh process, said at start when they may not:
    hybridpar asks MKL for its reproducible mode (hybridpar/__init__.py); another BLAS has no such switch."""
    if not mkl:
        return ["note: torch's CPU BLAS here is not MKL: its matmuls are not known to repeat bit for bit from one "
                "process to the next, so a resume continues the curve to rounding, not bitwise"]
    cbwr = env.get("MKL_CBWR", "").strip() if "MKL_CBWR" in env else "unset"
    if cbwr.upper() not in ("", "OFF", "UNSET"):  # a branch (AUTO, AVX2, COMPATIBLE, ... [,STRICT]): reproducible
        return []
    want = MKL_REPRODUCIBLE["MKL_CBWR"]
    return [f"note: MKL_CBWR={cbwr or '(empty)'} leaves MKL's matmuls free to round differently from one process "
            f"to the next (a resume continues to rounding, not bitwise); MKL_CBWR={want} is hybridpar's reproducible "
            f"default"]


def start_notes(cfg: Config, device: torch.device) -> list[str]:
    """What a run should know at start about its numerics on this device, once (the trainer prints them)."""
    m, t, notes = cfg.model, cfg.train, []
    if device.type == "cpu":
        notes += cpu_blas_notes(torch.backends.mkl.is_available(), os.environ)
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
