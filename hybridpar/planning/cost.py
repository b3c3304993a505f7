"""The planner: per-GPU memory and step time of a layout, from the model config and the layout alone.

Every byte count here is computed from shapes: the same arithmetic that TP (DTensor Shard placements) and FSDP2
(dim-0 chunks of the TP-local tensor) apply, so the parameter, gradient and optimizer bytes must equal what the
real parallelize function produces (`hybridpar.planning.dry_run` checks that, under a fake process group). Activations
follow the saved tensors of hybridpar's GPT block with fused (flash) attention; docs/planning.md writes out the
per-layer terms and how they were checked. The step time is an estimate from FLOPs and link bandwidths, with its
assumptions listed in GPUS and step_time().

Per-parameter local shapes (which rank holds which piece) live in hybridpar.planning.shapes; the search over layouts, the
start-up choices and the memory refusal in hybridpar.planning.layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridpar.config import Config
from hybridpar.planning.flops import flops_parts
from hybridpar.models import ModelConfig
from hybridpar.parallel import uses_fsdp
from hybridpar.parallel.fsdp import reshard_after_forward
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.shapes import LocalSizes, chunk, local_sizes

GIB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    """One GPU type: memory, dense bf16 peak, HBM bandwidth, per-GPU link bandwidths (one direction, GB/s), dense
    float8 peak (0: no float8 tensor cores)."""
    memory_gib: float
    peak_tflops: float
    hbm_gbps: float
    nvlink_gbps: float
    internode_gbps: float
    peak_fp8_tflops: float = 0.0

    @property
    def usable_bytes(self) -> int:
        """What a run may allocate: the memory less RESERVED_GIB."""
        return int((self.memory_gib - RESERVED_GIB) * GIB)


# Datasheet figures (NVIDIA H100/H200/A100/B200 datasheets; DGX/HGX reference designs with one 400 Gb/s NIC per GPU
# for H100/H200/B200 and one 200 Gb/s HDR NIC per GPU for A100). Memory in GiB as torch reports it.
GPUS: dict[str, GPU] = {
    "a100": GPU(memory_gib=79.2, peak_tflops=312.0, hbm_gbps=2039.0, nvlink_gbps=300.0, internode_gbps=25.0),
    "h100": GPU(memory_gib=79.1, peak_tflops=989.4, hbm_gbps=3350.0, nvlink_gbps=450.0, internode_gbps=50.0,
                peak_fp8_tflops=1978.9),
    # torchtitan's benchmark machine (its benchmarks/llama3_h100_202412_torchtitan.md): an SXM H100 with 96 GB of
    # HBM2e at 2.4 TB/s and the default 500 W power limit, whose peak "is between SXM and NVL" (989.4 and 835.5
    # dense bf16 TFLOPS on their datasheets): planned at their mean
    "h100-96gb-500w": GPU(memory_gib=89.4, peak_tflops=912.5, hbm_gbps=2400.0, nvlink_gbps=450.0,
                          internode_gbps=50.0, peak_fp8_tflops=1825.0),
    "h200": GPU(memory_gib=139.8, peak_tflops=989.4, hbm_gbps=4800.0, nvlink_gbps=450.0, internode_gbps=50.0,
                peak_fp8_tflops=1978.9),
    "b200": GPU(memory_gib=178.4, peak_tflops=2250.0, hbm_gbps=8000.0, nvlink_gbps=900.0, internode_gbps=50.0,
                peak_fp8_tflops=4500.0),
}

# The step-time model's constants, each with one physical cause. Two are fitted to published runs of five
# frameworks (tests/published_frameworks.py: fit(); the method, the leave-one-framework-out check and the table in
# docs/planning.md; tests/test_plan.py holds these equal to the fit):
GEMM_EFFICIENCY = 0.742    # model FLOPs / peak of a matrix multiply that is wide per rank and tall in tokens
EAGER_HBM_PASSES = 12.10   # without torch.compile: times a block's saved activations travel through HBM again per
#                            microbatch (its unfused norms, RoPE, activation, residual adds and casts, each a kernel)
# Two are published figures, not fitted. A GEMM's rate against its width: cuBLASLt's square GEMMs on an H100 SXM run
# at width / (width + 681) of their plateau at widths 2,048-8,192 (least squares; samuel-bohman/AI-benchmarking-guide,
# Azure_Results/ND_H100_v5_results.md, float8, the dtype it sweeps). A rank's width is d_model / tp, so tensor
# parallelism costs compute through the narrower GEMMs each rank runs, not through a constant factor.
GEMM_HALF_WIDTH = 681
# FlashAttention-2 forward + backward (head dim 128, batch 2, sequence 8192) reaches 327.9 TFLOPS on an H100 SXM
# (989.4 peak; the same benchmark): the attention FLOPs' share of the peak on every GPU type
ATTENTION_EFFICIENCY = 327.9 / 989.4
GEMM_FULL_RATE_TOKENS = 16384  # GEMM rows (micro-batch tokens) at which gemm_efficiency's token curve is 1
# Per-microbatch costs, which make many small microbatches slower than few large ones (docs/planning.md says how
# these were chosen; none is measured on a GPU yet):
GEMM_HALF_TOKENS = 512    # a GEMM with this many rows (tokens) runs at half its large-matrix rate
KERNELS_PER_BLOCK = {"gpt2": 50, "modern": 111}  # forward + backward ops of one block (benchmarks/kernels_per_block.py)
LAUNCH_S = 5e-6           # host time per kernel launch, exposed when kernels are short (CUDA launch latency, ~5 us)
FSDP_HOOKS_S = 100e-6     # FSDP2's pre/post forward and backward hooks of one block, per microbatch (host time)
LINK_EFFICIENCY = 0.80    # achieved bus bandwidth / link bandwidth of NCCL ring collectives at large message sizes
# How far the planned step is from published runs of frameworks it was not fitted to: each framework's steps planned
# with the fitted constants from the other four alone (lowest, highest, root mean square relative error;
# tests/published_frameworks.py prints the table, docs/planning.md; tests/test_plan.py keeps these equal)
OUT_OF_SAMPLE_STEP_ERROR = (-0.34, 0.29, 0.14)
RESERVED_GIB = 3.0        # CUDA context, NCCL buffers and allocator fragmentation kept out of the usable memory
RUNTIME_RESERVE_GIB = 2.0  # of a GPU's free memory at start (the context already out): NCCL buffers and allocator
#                            fragmentation; not yet measured on a GPU (benchmarks/h200_check.sh reports reserved -
#                            allocated at the peak, the figure to set it from)


# -- the plan ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """One rank's share of a run on a layout: everything the memory and time terms below read, derived once from
    the config by plan_of (the only function here that reads the config or calls outside this module). A study
    varies one field with dataclasses.replace, e.g. fsdp=False for bf16 under autocast."""
    m: ModelConfig
    layout: Layout
    sizes: LocalSizes          # this rank's parameter sizes (hybridpar.planning.shapes.local_sizes)
    flops: dict                # training FLOPs per token by part (hybridpar.planning.flops.flops_parts)
    muon: dict                 # this rank's Newton-Schulz FLOPs and all-to-all bytes (zeros for AdamW)
    seq_len: int
    micro: int                 # sequences per microbatch
    n_micro: int               # microbatches per step on each data-parallel rank
    global_batch: int
    precision: str = "fp32"    # the compute dtype: fp32 | bf16
    fsdp: bool = False         # fully_shard wraps the model (hybridpar.parallel.uses_fsdp)
    unsharded: bool = False    # FSDP holds gathered parameters and unsharded gradients between microbatches
    reshard: bool | int = True  # what a block keeps after forward (hybridpar.parallel.fsdp.reshard_after_forward)
    prefetch: int = 1
    cpu_offload: bool = False
    exact: bool = False        # parallel.exact_reduction
    sp: bool = False
    ac: str = "none"
    ac_every: int = 1
    compile: bool = False
    loss_chunk_tokens: int = 0
    math_attention: bool = False  # the unfused attention kernel (what CUDA runs for fp32 grouped-query attention)
    fp8: str = "off"
    fp8_linears: str = "blocks"
    fp8_all_gather: bool = False
    optimizer: str = "adamw"
    state_bytes: int = 4       # per element of each AdamW moment (optim.state_dtype)
    master_bytes: int = 4      # per element of the weights and their gradients (optim.master_dtype)
    kahan: bool = False        # bf16 master weights keep a bf16 compensation buffer (optim.master_rounding=kahan)
    # share of the blocks' forward matmuls that selective checkpointing recomputes: hybridpar's policy recomputes
    # none; a study of another framework's policy sets it (a per-op policy that saves every second matmul: 0.5)
    recomputed_matmuls: float = 0.0

    tokens = property(lambda self: self.micro * self.seq_len // self.layout.cp)  # of one microbatch, on this rank
    a = property(lambda self: 2 if self.precision == "bf16" else 4)  # bytes per element of the compute dtype
    autocast = property(lambda self: self.precision == "bf16" and not self.fsdp)  # (no FSDP mixed precision)
    fused_loss = property(lambda self: bool(self.loss_chunk_tokens) and self.layout.tp == 1)  # chunked head + loss


def plan_of(cfg: Config, layout: Layout, rank: int = 0) -> Plan:
    """The Plan of `rank` running `cfg` on `layout`."""
    from hybridpar.training.muon import owner_share

    m, t, p, o = cfg.model, cfg.train, cfg.parallel, cfg.optim
    micro = t.micro_batch_size or t.global_batch_size // layout.dp
    n_micro = t.global_batch_size // (micro * layout.dp)
    flops, sizes = flops_parts(m, t.seq_len), local_sizes(m, layout, rank)
    muon = {"muon_ns_flops": 0, "muon_comm_bytes": 0}
    if o.name == "muon":  # matrix j of a shard group of dp_shard x cp x tp ranks is owned by member j mod n
        tp_rank = layout.coords(rank)[3]
        muon = owner_share([shape for shape, _ in sizes.hidden], [held for _, held in sizes.hidden],
                           layout.fsdp * layout.tp, layout.fsdp_index(rank) * layout.tp + tp_rank, o.muon_ns_steps,
                           o.muon_distribution == "gather")
    fsdp, precision = uses_fsdp(cfg, layout.dp * layout.cp), t.precision or "fp32"
    # "auto" counts as false here, the mode that always needs less (hybridpar.planning.layouts.choose_accumulation
    # settles it for a device); nothing is held without FSDP or with one microbatch
    unsharded = p.accumulate_unsharded is True and fsdp and n_micro > 1
    # On CUDA, fp32 grouped-query attention has no fused kernel (flash needs 16-bit inputs; the memory-efficient
    # kernel takes no GQA): SDPA falls back to the math kernel
    math_attention = precision == "fp32" and m.kv_heads < m.n_heads
    return Plan(m, layout, sizes, flops, muon, t.seq_len, micro, n_micro, t.global_batch_size, precision, fsdp,
                unsharded, reshard_after_forward(p), p.fsdp_prefetch, p.fsdp_cpu_offload, p.exact_reduction,
                p.sequence_parallel, t.activation_checkpointing, t.ac_every, t.compile, t.loss_chunk_tokens,
                math_attention, t.fp8, t.fp8_linears, t.fp8_all_gather, o.name, 2 if o.state_dtype == "bf16" else 4,
                2 if o.master_dtype == "bf16" else 4, o.master_dtype == "bf16" and o.master_rounding == "kahan")


# -- memory --------------------------------------------------------------------------------------------------------

def _norm_bytes(plan: Plan, s: int, r: int) -> float:
    """Input + statistics one norm keeps, per token: LayerNorm its input r*H/s and mean, rstd; RMSNorm (computed
    in fp32) fp32 x, x * rstd and rstd."""
    H = plan.m.d_model
    return (r * H + 8) / s if plan.m.norm == "layernorm" else (8 * H + 4) / s


def _layer_bytes(plan: Plan, s: int, r: int) -> float:
    """What one block without checkpointing keeps, per token (t = tp, s = tp with sequence parallelism else 1;
    r, a = residual and matmul dtype bytes): two norms; the attention input a*H (under SP without checkpointing
    its sequence shard a*H/s, gathered again in backward; under autocast one full copy per projection: 3); q, k, v
    after RoPE a*(nh + 2 nkv)*hd/t; the attention output a*nh*hd/t (also the input of wo); log-sum-exp 4*nh/t; the
    MLP input a*H, a*H/s as the attention's (autocast: 1 copy, or 2 for SwiGLU's gate and up); GELU: its input and
    output a*2F/t; SwiGLU: gate, up, silu(gate), product a*4F/t. Under torch.compile the blocks keep their
    gathered inputs (the sequence-shard hooks are not applied: compiled graphs would not see through them).
    math_attention also keeps the softmax probabilities 4*nh*T/t per token and key/value expanded to every query
    head, a*2(nh - nkv)*hd/t more, and no log-sum-exp. Context parallelism (cp ranks, T/cp tokens each) keeps the
    gathered keys and values of the whole sequence, a*2*nkv*hd*cp/t per local token, and the two query chunks'
    outputs beside their concatenation, a*nh*hd/t more (hybridpar/parallel/context.py)."""
    m, tp, a = plan.m, plan.layout.tp, plan.a
    H, hd = m.d_model, m.head_dim
    nh, nkv = m.n_heads / tp, m.kv_heads / tp
    # Under SP without checkpointing, attention and MLP keep their input's sequence shard and gather it again in
    # backward (hybridpar/parallel/sequence_shard.py); so does the LM head whatever the checkpointing.
    shard = s if (plan.ac == "none" and not plan.autocast and not plan.compile) else 1
    attn_in = a * H * (3 if plan.autocast else 1) / shard
    mlp_in = a * H * (2 if (plan.autocast and m.mlp == "swiglu") else 1) / shard
    inner = a * (4 if m.mlp == "swiglu" else 2) * m.ffn_dim / tp
    scores = (4 * nh * plan.seq_len + a * 2 * (nh - nkv) * hd - 4 * nh) if plan.math_attention else 0
    cp = plan.layout.cp  # context parallelism: the keys and values of the whole sequence, and the chunks' outputs
    kv = a * 2 * nkv * hd * cp + (a * nh * hd if cp > 1 else 0)  # beside their concatenation (wo's input)
    return 2 * _norm_bytes(plan, s, r) + attn_in + a * nh * hd + kv + a * nh * hd + 4 * nh + mlp_in + inner + scores


def _checkpointed(plan: Plan, layer: float, s: int, r: int) -> tuple[float, float]:
    """(what all blocks keep, what backward recomputes at once), per token, under the checkpointing mode: full
    keeps a checkpointed block's input only and re-runs one block at a time; selective keeps each branch's input
    (the residual stream, its sequence shard under SP), the outputs of its linears but the last (q, k, v; the MLP's
    first matmuls) and of fused attention (also the output projection's input); the output and down projections'
    outputs are neither kept nor recomputed (except under fp8: torchao's float8 linears keep them, (tokens, H)
    each, partial sums under TP)."""
    m, tp, a, L = plan.m, plan.layout.tp, plan.a, plan.m.n_layers
    if plan.ac == "full":
        ckpt = len(range(0, L, plan.ac_every))
        return (L - ckpt) * layer + ckpt * r * m.d_model / s, layer
    if plan.ac == "selective":
        nh, nkv = m.n_heads / tp, m.kv_heads / tp
        kept = (2 * r * m.d_model / s + a * (nh + 2 * nkv) * m.head_dim + a * nh * m.head_dim + 4 * nh
                + a * (2 if m.mlp == "swiglu" else 1) * m.ffn_dim / tp
                + (2 * a * m.d_model if plan.fp8 != "off" else 0))
        return L * kept, max(0, layer - kept)  # recomputed: norms, RoPE, activation, ...
    return L * layer, 0


def _outside_bytes(plan: Plan, s: int, r: int) -> int:
    """Outside the blocks: the token ids, the position ids (learned positions) or the RoPE tables, the final
    norm's input and statistics, the LM head's input (not with the fused loss, which keeps gradients instead: its
    sequence shard under SP); under context parallelism the attention masks and key order every layer shares."""
    m, tokens, cp = plan.m, plan.tokens, plan.layout.cp
    outside = 8 * tokens
    plain_blocks = plan.ac == "none" or (plan.ac == "full" and plan.ac_every > 1)  # (blocks whose forward is kept)
    if m.position == "learned":
        outside += 8 * plan.seq_len // cp
    elif plain_blocks:  # the cos/sin tables the RoPE multiplies save (under cp: their rows at the rank's positions)
        outside += 2 * (plan.seq_len // cp if cp > 1 else m.max_seq_len) * m.head_dim // 2 * 4
    if cp > 1 and plain_blocks:  # context parallelism: the gather's sequence order (int64) and the two query
        c = plan.seq_len // (2 * cp)  # chunks' additive masks, c x (g + 1) c for chunks g = rank and 2 cp - 1 - rank
        outside += 8 * plan.seq_len + plan.a * c * c * (2 * cp + 1)
    outside += _norm_bytes(plan, s, r) * tokens
    if not plan.fused_loss:
        outside += plan.a * m.d_model * tokens / (1 if plan.autocast else s)
    return int(outside)


def _shard_and_residual(plan: Plan) -> tuple[int, int]:
    """(s, r): the sequence-parallel shard count (tp under SP, else 1) and the residual stream's bytes per element."""
    tp = plan.layout.tp
    return (tp if plan.sp and tp > 1 else 1), (4 if (plan.precision == "fp32" or plan.autocast) else 2)


def activation_bytes(plan: Plan) -> dict[str, int]:
    """Bytes one microbatch keeps for backward on one rank, by part (docs/planning.md writes the terms out).

    The dtypes: fp32 keeps everything in fp32; bf16 with FSDP (hybridpar's bf16 on any mesh) computes with bf16
    parameters, so the residual stream and every saved tensor are bf16; bf16 under autocast (a custom parallelize
    function without FSDP): the residual stream and norms stay fp32, each projection saves its own bf16 copy of its
    input, and the bf16 copies of the weights are kept (autocast's cache) until backward, except in fully
    checkpointed blocks, which cast them again when they recompute."""
    tp = plan.layout.tp
    s, r = _shard_and_residual(plan)
    layer = _layer_bytes(plan, s, r)
    kept, recompute = _checkpointed(plan, layer, s, r)
    out = {"layers": int(kept * plan.tokens), "outside_layers": _outside_bytes(plan, s, r),
           "recompute_peak": int(recompute * plan.tokens)}
    if plan.autocast:
        L = plan.m.n_layers
        kept_blocks = L - (len(range(0, L, plan.ac_every)) if plan.ac == "full" else 0)
        out["autocast_weight_copies"] = 2 * (kept_blocks * plan.sizes.block_matrices // tp
                                             + chunk(plan.m.vocab_size, tp, 0) * plan.m.d_model)
    return out


def logits_bytes(plan: Plan) -> int:
    """Peak bytes of the LM head + loss for one microbatch.

    Plain path (no loss chunks, or tp > 1 with the vocab-parallel loss; vocab / tp per rank): the logits in the
    compute dtype, the loss's fp32 log-softmax and its gradient. Fused path (hybridpar's linear_cross_entropy,
    tp = 1): one chunk's fp32 logits and their compute-dtype gradient, the fp32 accumulator of the weight gradient
    and its compute-dtype copy, and the input gradient it keeps for backward.
    """
    V, H, a, tokens = plan.m.vocab_size, plan.m.d_model, plan.a, plan.tokens
    if plan.fused_loss:
        return min(plan.loss_chunk_tokens, tokens) * V * (4 + a) + V * H * (4 + a) + tokens * H * a
    return tokens * chunk(V, plan.layout.tp, 0) * (a + 8)


def accumulation_bytes(plan: Plan) -> int:
    """Bytes a rank holds between two microbatches of a step, beyond its parameters and optimizer state.
    Unsharded accumulation: every FSDP group's gathered parameters (compute dtype) and unsharded gradients (fp32,
    FSDP's reduce dtype), i.e. (2 + 4) bytes per tensor-parallel-local parameter in bf16 and (4 + 4) in fp32.
    Otherwise: the sharded fp32 gradients the microbatches accumulate into (under HSDP, FSDP's partial
    reduce-scatter output of the same size), which the plan counts as grads_bytes_per_gpu. parallel.exact_reduction
    adds its int64 accumulator of the sharded gradients: (8 + 4) bytes per local parameter."""
    if plan.exact:  # the int64 accumulator beside the (zero) fp32 gradients FSDP keeps
        return (8 + 4) * plan.sizes.params
    if not plan.unsharded:
        return plan.master_bytes * plan.sizes.params
    return (plan.a + 4) * plan.sizes.tp_params


def fsdp_buffer_bytes(plan: Plan) -> int:
    """FSDP's unsharded parameters of the blocks in flight and of the root (kept from forward to backward), one
    block's unsharded gradient, and its fp32 reduce-scatter input when computing in bf16; resharding to N ranks
    keeps every block's 1/N piece from its forward to its backward; exact reduction quantizes a block's
    reduce-scatter input to int64."""
    if not plan.fsdp:
        return 0
    L, block, root, reshard = plan.m.n_layers, plan.sizes.tp_block, plan.sizes.tp_root, plan.reshard
    held = L if reshard is False else min(L, 1 + plan.prefetch)
    kept = 0 if isinstance(reshard, bool) else L * math.ceil(block / reshard)
    buffers = plan.a * (held * block + root + kept) + plan.a * block + (4 * block if plan.precision == "bf16" else 0)
    return buffers + (8 * block if plan.exact else 0)


def optimizer_bytes(plan: Plan) -> int:
    """AdamW: two moments per parameter (fp32, or bf16 with optim.state_dtype=bf16), a 4-byte step per tensor, and
    with bf16 master weights under Kahan rounding a bf16 compensation per parameter; Muon's matrices: one fp32
    buffer."""
    hidden = plan.sizes.hidden if plan.optimizer == "muon" else ()
    muon = sum(held for _, held in hidden)
    moments = (2 * plan.state_bytes + (2 if plan.kahan else 0)) * (plan.sizes.params - muon)
    return 4 * muon + moments + 4 * (plan.sizes.tensors - len(hidden))


def memory(plan: Plan) -> dict:
    """Bytes per GPU of one rank, by part. Parameters are kept in fp32 (bf16 is a compute dtype) or, with
    optim.master_dtype=bf16, in bf16; gradients in the same dtype with the parameters' local shapes; the optimizer
    state as optimizer_bytes counts it.
    Unsharded gradient accumulation adds the whole tensor-parallel-local model's gathered parameters and fp32
    gradients (accumulation_bytes_per_gpu; 0 otherwise; parallel.exact_reduction's int64 accumulator there)."""
    params, acts, between = plan.master_bytes * plan.sizes.params, activation_bytes(plan), accumulation_bytes(plan)
    out = {
        "params_bytes_per_gpu": params,
        "grads_bytes_per_gpu": params,
        "optimizer_bytes_per_gpu": optimizer_bytes(plan),
        "activations_bytes_per_gpu": sum(acts.values()),
        "activations": acts,
        "logits_bytes_per_gpu": logits_bytes(plan),
        "fsdp_buffers_bytes_per_gpu": fsdp_buffer_bytes(plan),
        # (parallel.exact_reduction: its int64 accumulator, beside the gradients FSDP keeps)
        "accumulation_bytes_per_gpu": between if plan.unsharded else 8 * plan.sizes.params if plan.exact else 0,
        "between_microbatches_bytes_per_gpu": between,
    }
    on_gpu = ["activations_bytes_per_gpu", "logits_bytes_per_gpu", "fsdp_buffers_bytes_per_gpu",
              "accumulation_bytes_per_gpu"]
    if not (plan.fsdp and plan.cpu_offload):
        on_gpu += ["params_bytes_per_gpu", "grads_bytes_per_gpu", "optimizer_bytes_per_gpu"]
    out["total_bytes_per_gpu"] = sum(out[k] for k in on_gpu)
    return out


# -- time ----------------------------------------------------------------------------------------------------------

def _ring(bytes_: float, n: int, gbps: float, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather / reduce-scatter (or all-reduce = both) of `bytes_` (the full tensor) over n."""
    if n <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (n - 1) / n * bytes_ / (gbps * 1e9 * LINK_EFFICIENCY)


def token_curve(tokens: int) -> float:
    """GEMM rate at `tokens` rows relative to GEMM_FULL_RATE_TOKENS rows: M / (M + GEMM_HALF_TOKENS), normalised
    (2048-token microbatches run at 83% of a 16k-token one's rate)."""
    def curve(m):
        return m / (m + GEMM_HALF_TOKENS)
    return curve(tokens) / curve(GEMM_FULL_RATE_TOKENS)


def exposed_fsdp(comm: float, compute: float) -> float:
    """Seconds of FSDP link time `comm` that a step with `compute` seconds of compute does not hide: the link's
    share of the two, comm / (comm + compute), of it. FSDP's collectives run beside compute and contend with it
    (SMs, HBM): little of a small transfer shows, nearly all of one that outlasts compute. No fitted constant: the
    form planned other frameworks' runs better than a fitted constant share (docs/planning.md)."""
    return comm * comm / (comm + compute) if comm > 0 else 0.0


def gemm_efficiency(tokens: int, width: float) -> float:
    """Model FLOPs / peak for GEMMs of `tokens` rows in layers `width` wide on one rank (d_model / tp: a TP rank's
    column-parallel GEMMs have 1/tp of the output columns, its row-parallel ones 1/tp of the inner dimension):
    GEMM_EFFICIENCY x width / (width + GEMM_HALF_WIDTH) x token_curve(tokens)."""
    return GEMM_EFFICIENCY * width / (width + GEMM_HALF_WIDTH) * token_curve(tokens)


def all_gather_bytes(plan: Plan) -> int:
    """Bytes of one FSDP all-gather of the whole model by a TP rank (its tp shard of every parameter): the compute
    dtype's, or 1 byte for the weights train.fp8=tensorwise all-gathers in float8 (train.fp8_all_gather)."""
    sizes = plan.sizes
    if plan.fp8 != "tensorwise" or not plan.fp8_all_gather:
        return sizes.tp_params * plan.a
    fp8 = sizes.tp_hidden + (sizes.tp_head if plan.fp8_linears == "all" else 0)
    return fp8 + (sizes.tp_params - fp8) * plan.a


def root_gather_bytes(plan: Plan) -> int:
    """The part of all_gather_bytes that is the root's (embeddings, final norm, LM head): FSDP keeps the root's
    parameters gathered from its forward to its backward, so it gathers them once a forward, the blocks twice."""
    sizes, a = plan.sizes, plan.a
    if plan.fp8 == "tensorwise" and plan.fp8_all_gather and plan.fp8_linears == "all":
        return sizes.tp_root * a - (a - 1) * sizes.tp_head
    return sizes.tp_root * a


def _checkpointed_blocks(plan: Plan) -> int:
    return len(range(0, plan.m.n_layers, plan.ac_every)) if plan.ac == "full" else 0


def compute_time(plan: Plan, gpu: GPU) -> dict:
    """Model FLOPs, plus the recomputed forward of each fully checkpointed block up to its down projection (and,
    under selective checkpointing, plan.recomputed_matmuls of the blocks' forward matmuls): the matmuls at
    gemm_efficiency(micro-batch tokens, d_model / tp) of the peak, the attention scores and sums at
    ATTENTION_EFFICIENCY (gemm_at_peak_s, attention_at_peak_s: their seconds at the peak). Under train.fp8 the
    converted linears' FLOPs (the blocks', and the LM head's with fp8_linears=all) run at the float8 peak, the rest
    at bf16's (the casts and scales are not counted: an upper bound until measured on a GPU). Under context
    parallelism the attention term is (2 cp + 1) / (2 cp) of the causal count: each query chunk's masked block
    over the keys before its end (hybridpar/parallel/context.py)."""
    m, parts, layout = plan.m, plan.flops, plan.layout
    ckpt = _checkpointed_blocks(plan)
    # a fully checkpointed block recomputes its forward up to the down projection's input: recomputation stops once
    # backward has what it needs (measured with FlopCounterMode: tests/test_activation_checkpointing.py)
    block_mm = parts["blocks"] / m.n_layers / 3  # one block's forward matmuls, per token
    blocks = parts["blocks"] + ckpt * (block_mm - 2 * m.d_model * m.ffn_dim)
    if plan.ac == "selective":
        blocks += plan.recomputed_matmuls * parts["blocks"] / 3
    attention = parts["attention"] * (1 + ckpt / m.n_layers / 3)
    fp8 = plan.fp8 != "off" and gpu.peak_fp8_tflops > 0
    fp8_mm = (blocks + (parts["head"] if plan.fp8_linears == "all" else 0)) if fp8 else 0
    tokens = plan.global_batch * plan.seq_len / layout.dp / layout.cp / layout.tp / 1e12  # this TP group's, a step
    gemm = ((blocks + parts["head"] - fp8_mm) / gpu.peak_tflops + fp8_mm / (gpu.peak_fp8_tflops or 1.0)) * tokens
    if layout.cp > 1:  # each query chunk's masked block over its keys: (2 cp + 1) / (4 cp) of dense, not 1/2
        attention *= (2 * layout.cp + 1) / (2 * layout.cp)
    attn = attention / gpu.peak_tflops * tokens
    rate = gemm_efficiency(plan.tokens, m.d_model / layout.tp)
    return {"compute_s": gemm / rate + attn / ATTENTION_EFFICIENCY, "compute_at_peak_s": gemm + attn,
            "gemm_at_peak_s": gemm, "attention_at_peak_s": attn}


def eager_time(plan: Plan, gpu: GPU) -> dict:
    """Without torch.compile, every elementwise op of a block (norms, RoPE, the activation, residual adds, casts) is
    its own kernel that reads and writes its tensors in HBM: EAGER_HBM_PASSES times the bytes the block keeps for
    backward (_layer_bytes), per block and microbatch (eager_traffic_s: one pass)."""
    if plan.compile:
        return {"eager_s": 0.0, "eager_traffic_s": 0.0}
    one = plan.n_micro * plan.m.n_layers * _layer_bytes(plan, *_shard_and_residual(plan)) * plan.tokens / (gpu.hbm_gbps * 1e9)
    return {"eager_s": EAGER_HBM_PASSES * one, "eager_traffic_s": one}


def tp_time(plan: Plan, gpu: GPU) -> float:
    """Per layer and microbatch, 2 all-reduces forward and 2 backward of the (tokens, H) activations (reduce-
    scatter + all-gather under SP: the same bytes), plus the recomputed forward's 2, plus under SP the all-gathers
    of inputs kept as sequence shards (attention and MLP of blocks not fully checkpointed, 2 per block, and the LM
    head: half an all-reduce each; selective checkpointing recomputes them, and under compile without checkpointing
    the blocks keep their inputs gathered, so only the LM head's); over NVLink; not overlapped."""
    L = plan.m.n_layers
    act = plan.tokens * plan.m.d_model * plan.a
    blocks_regather = L if plan.ac == "selective" or (plan.ac == "none" and not plan.compile) else 0
    regather = (2 * blocks_regather + 1) * 0.5 if plan.sp else 0
    per_micro = (4 * L + 2 * _checkpointed_blocks(plan) + 2 + regather) * _ring(act, plan.layout.tp, gpu.nvlink_gbps,
                                                                                 all_reduce=True)
    return plan.n_micro * per_micro


def cp_time(plan: Plan, gpu: GPU) -> float:
    """Context parallelism's collectives, per layer and microbatch: the all-gather of the keys and values (2 x micro
    x seq_len x kv_heads / tp x head_dim elements gathered) in forward, again in each recomputed forward (fully
    checkpointed blocks; under selective checkpointing every block), and the reduce-scatter of their gradients in
    backward; over NVLink (cp x tp inside a node, which resolve checks); not overlapped (each is waited for where
    attention needs it)."""
    cp, m = plan.layout.cp, plan.m
    if cp == 1:
        return 0.0
    gathered = 2 * plan.micro * plan.seq_len * m.kv_heads // plan.layout.tp * m.head_dim * plan.a
    recomputed = m.n_layers if plan.ac == "selective" else _checkpointed_blocks(plan)
    return plan.n_micro * (2 * m.n_layers + recomputed) * _ring(gathered, cp, gpu.nvlink_gbps)


def fsdp_time(plan: Plan, gpu: GPU, gpus_per_node: int, compute: float) -> dict:
    """All-gathers of the bf16 parameters and fp32 reduce-scatters of the gradients: with unsharded accumulation
    (or one microbatch) forward gathers once, backward once per microbatch with full_shard, and one reduce-scatter
    per step; with sharded accumulation every microbatch gathers in forward (and in backward with full_shard) and
    reduce-scatters; the root (embeddings, final norm, LM head), kept gathered from forward to backward, is
    gathered once a step or once a microbatch (fsdp_gather_bytes, fsdp_scatter_bytes: the step's totals,
    full-tensor sizes, as measured on ranks in tests/test_parallel.py); with HSDP one fp32 all-reduce of the
    gradient shards across replicas; parallel.exact_reduction reduce-scatters every microbatch and all-reduces
    across replicas in int64 (8 bytes an element; its per-step MAX of one float64 per parameter tensor and the
    grad norm's few scalars are not counted); tensorwise fp8 with fp8_all_gather gathers those weights in 1 byte.
    Over NVLink when the group fits in a node, else the per-GPU inter-node link; exposed_fsdp says how much compute
    does not hide."""
    layout, n_micro, reshard = plan.layout, plan.n_micro, plan.reshard
    gathered = all_gather_bytes(plan)
    out = {"fsdp_comm_s": 0.0, "fsdp_exposed_s": 0.0, "all_gather_bytes": gathered, "fsdp_gather_bytes": 0,
           "fsdp_scatter_bytes": 0}
    if layout.dp * layout.cp == 1:
        return out
    params_tp, shard = plan.sizes.tp_params, layout.fsdp  # (FSDP shards over dp_shard x cp)
    shard_bw = gpu.nvlink_gbps if shard * layout.tp <= gpus_per_node else gpu.internode_gbps
    root = root_gather_bytes(plan)
    blocks = gathered - root
    # the blocks' gathers (forward, and backward when resharded after forward); the root's, once a forward
    if n_micro == 1 or plan.unsharded:
        gathers, root_gathers, scatters = 1 + (n_micro if reshard is True else 0), 1, 1
    else:
        gathers, root_gathers, scatters = n_micro * (2 if reshard is True else 1), n_micro, n_micro
    grad_bytes = 8 if plan.exact else 4  # (the mode reduces int64: hybridpar.parallel.exact)
    gather_bytes, scatter_bytes = gathers * blocks + root_gathers * root, scatters * params_tp * grad_bytes
    fsdp = _ring(gather_bytes, shard, shard_bw) + _ring(scatter_bytes, shard, shard_bw)
    if not isinstance(reshard, bool):  # backward's all-gathers of the blocks within groups of N ranks
        group_bw = gpu.nvlink_gbps if reshard * layout.tp <= gpus_per_node else gpu.internode_gbps
        fsdp += n_micro * _ring(blocks, reshard, group_bw)
    rep_bw = gpu.nvlink_gbps if layout.world <= gpus_per_node else gpu.internode_gbps
    fsdp += _ring(params_tp * grad_bytes / shard, layout.dp_replicate, rep_bw, all_reduce=True)
    return {**out, "fsdp_comm_s": fsdp, "fsdp_exposed_s": exposed_fsdp(fsdp, compute),
            "fsdp_gather_bytes": gather_bytes, "fsdp_scatter_bytes": scatter_bytes}


def optimizer_time(plan: Plan, gpu: GPU, gpus_per_node: int) -> dict:
    """AdamW streams 28 bytes per local parameter (read p, g, m, v; write p, m, v: 3 x the weights' bytes + 4 x the
    moments'; 20 with bf16 moments, 14 with bf16 weights too, 4 more for a Kahan compensation) through HBM, Muon's
    matrices 20
    (read p, g, b; write p, b); Muon's Newton-Schulz FLOPs of this rank's share (rank 0 owns the most matrices) at
    gemm_efficiency of the bf16 peak, and its two all-to-alls over NVLink when the shard group fits in a node; not
    overlapped."""
    layout, d_model = plan.layout, plan.m.d_model
    streamed = 3 * plan.master_bytes + 4 * plan.state_bytes + (4 if plan.kahan else 0)
    optimizer = streamed * plan.sizes.params / (gpu.hbm_gbps * 1e9)
    if plan.optimizer == "muon":
        optimizer -= 8 * sum(held for _, held in plan.sizes.hidden) / (gpu.hbm_gbps * 1e9)
    ns = plan.muon["muon_ns_flops"] / (gpu.peak_tflops * 1e12 * gemm_efficiency(GEMM_FULL_RATE_TOKENS, d_model))
    bw = gpu.nvlink_gbps if layout.dp_shard * layout.tp <= gpus_per_node else gpu.internode_gbps
    return {"optimizer_s": optimizer, "muon_ns_s": ns,
            "muon_comm_s": plan.muon["muon_comm_bytes"] / (bw * 1e9 * LINK_EFFICIENCY)}


def selective_recompute_time(plan: Plan, gpu: GPU) -> float:
    """Selective checkpointing recomputes no matmul, but its norms, RoPE and activation: memory-bound, timed as
    their outputs written and inputs read once more through HBM, per block and microbatch."""
    if plan.ac != "selective":
        return 0.0
    redo = activation_bytes(replace(plan, compile=False, math_attention=False))["recompute_peak"]
    return plan.n_micro * plan.m.n_layers * 2 * redo / (gpu.hbm_gbps * 1e9)


def overhead_time(plan: Plan) -> float:
    """Kernel launches and FSDP hooks, per block and microbatch."""
    m = plan.m
    kernels = KERNELS_PER_BLOCK["modern" if m.position == "rope" or m.mlp == "swiglu" else "gpt2"]
    return plan.n_micro * m.n_layers * (kernels * LAUNCH_S + (FSDP_HOOKS_S if plan.fsdp else 0.0))


STEP_TERMS = ("compute_s", "eager_s", "selective_recompute_s", "tp_comm_s", "cp_comm_s", "fsdp_exposed_s",
              "optimizer_s", "muon_ns_s", "muon_comm_s", "per_microbatch_overhead_s")


def step_time(plan: Plan, gpu: GPU, gpus_per_node: int) -> dict:
    """Estimated seconds of one optimizer step of plan's rank, by term (STEP_TERMS; each function's docstring says
    what it counts), with the rates they give. Rank 0's plan times the step: its shards (ceil-sized first) and its
    Muon share are the largest."""
    out = {**compute_time(plan, gpu), **eager_time(plan, gpu)}
    out.update(fsdp_time(plan, gpu, gpus_per_node, out["compute_s"]), **optimizer_time(plan, gpu, gpus_per_node),
               selective_recompute_s=selective_recompute_time(plan, gpu), tp_comm_s=tp_time(plan, gpu),
               cp_comm_s=cp_time(plan, gpu),
               per_microbatch_overhead_s=overhead_time(plan))
    total = out["step_time_s"] = sum(out[k] for k in STEP_TERMS)
    tokens, fpt = plan.global_batch * plan.seq_len, sum(plan.flops.values())
    fp8 = plan.fp8 != "off" and gpu.peak_fp8_tflops > 0
    return {**out, "tokens_per_sec": tokens / total,
            "mfu": fpt * tokens / total / plan.layout.world / (gpu.peak_tflops * 1e12),
            "mfu_fp8": fpt * tokens / total / plan.layout.world / (gpu.peak_fp8_tflops * 1e12) if fp8 else None}
