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
from dataclasses import dataclass

from hybridpar.config import Config
from hybridpar.planning.flops import flops_parts
from hybridpar.models import ModelConfig
from hybridpar.parallel import uses_fsdp
from hybridpar.parallel.fsdp import reshard_after_forward
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.shapes import chunk, local_sizes, numel, param_specs

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
    "h200": GPU(memory_gib=139.8, peak_tflops=989.4, hbm_gbps=4800.0, nvlink_gbps=450.0, internode_gbps=50.0,
                peak_fp8_tflops=1978.9),
    "b200": GPU(memory_gib=178.4, peak_tflops=2250.0, hbm_gbps=8000.0, nvlink_gbps=900.0, internode_gbps=50.0,
                peak_fp8_tflops=4500.0),
}

# Efficiency constants of the step-time estimate, fitted to published measurements (tests/published_runs.py: fit(),
# the method in docs/planning.md; tests/test_plan.py checks these equal the fit): 14 rows of an FSDP2 + TP
# sweep on H200s and a plain 1.3B step on one H200.
GEMM_EFFICIENCY = 0.753   # model FLOPs / peak of a compiled dense step of a very wide model at large micro-batches
GEMM_HALF_WIDTH = 768     # d_model at which that rate halves: wider layers run closer to it (width / (width + this))
TP_COMPUTE_PENALTY = 0.352  # a tensor-parallel step computes this much longer than its FLOPs say (smaller GEMMs per
#                            rank, the norms and casts between them; its collectives are counted apart)
FSDP_EXPOSED_SHARE = 0.456  # share of FSDP's all-gathers and reduce-scatters that compute does not hide
GEMM_FULL_RATE_TOKENS = 16384  # GEMM rows (micro-batch tokens) at which gemm_efficiency's token curve is 1
# Per-microbatch costs, which make many small microbatches slower than few large ones (docs/planning.md says how
# these were chosen; none is measured on a GPU yet):
GEMM_HALF_TOKENS = 512    # a GEMM with this many rows (tokens) runs at half its large-matrix rate
KERNELS_PER_BLOCK = {"gpt2": 50, "modern": 111}  # forward + backward ops of one block (benchmarks/kernels_per_block.py)
LAUNCH_S = 5e-6           # host time per kernel launch, exposed when kernels are short (CUDA launch latency, ~5 us)
FSDP_HOOKS_S = 100e-6     # FSDP2's pre/post forward and backward hooks of one block, per microbatch (host time)
LINK_EFFICIENCY = 0.80    # achieved bus bandwidth / link bandwidth of NCCL ring collectives at large message sizes
RESERVED_GIB = 3.0        # CUDA context, NCCL buffers and allocator fragmentation kept out of the usable memory
RUNTIME_RESERVE_GIB = 2.0  # of a GPU's free memory at start (the context already out): NCCL buffers and allocator
#                            fragmentation; not yet measured on a GPU (benchmarks/h200_check.sh reports reserved -
#                            allocated at the peak, the figure to set it from)


# -- memory --------------------------------------------------------------------------------------------------------

def _compute_bytes(precision: str | None) -> int:
    """Bytes per element of the compute dtype (bf16 or fp32)."""
    return 2 if precision == "bf16" else 4


def activation_bytes(m: ModelConfig, tokens: int, seq_len: int, tp: int, sp: bool, precision: str, fsdp: bool,
                     ac: str, ac_every: int = 1, fused_loss: bool = False, compile: bool = False,
                     math_attention: bool = False, fp8_blocks: bool = False) -> dict[str, int]:
    """Bytes one microbatch of `tokens` keeps for backward on one rank, by part.

    precision/fsdp choose the dtypes: fp32 keeps everything in fp32; bf16 with FSDP (hybridpar's bf16 on any mesh)
    computes with bf16 parameters, so the residual stream and every saved tensor are bf16; bf16 under autocast
    (a custom parallelize function without FSDP): the residual
    stream and norms stay fp32, each projection saves its own bf16 copy of its input, and the bf16 copies of the
    weights are kept (autocast's cache) until backward.

    Per layer and token (t = tp, s = tp with sequence parallelism else 1; r, a = residual and matmul dtype bytes):
      LayerNorm: its input r*H/s and mean, rstd; RMSNorm (computed in fp32): x, x*rstd, rstd in fp32; twice;
      attention input a*H (under SP without checkpointing its sequence shard a*H/s, gathered again in backward;
      under autocast one full copy per projection: 3);
      q, k, v after RoPE a*(nh + 2 nkv)*hd/t; attention output a*nh*hd/t (also the input of wo);
      log-sum-exp 4*nh/t; MLP input a*H, a*H/s as the attention's (autocast: 1 copy, or 2 for SwiGLU's gate and up);
      GELU: its input and output a*2F/t; SwiGLU: gate, up, silu(gate), product a*4F/t.
    Under torch.compile the blocks keep their gathered inputs (the sequence-shard hooks are not applied: compiled
    graphs would not see through them). math_attention: the unfused attention kernel (what CUDA runs for fp32
    grouped-query attention) also keeps the softmax probabilities 4*nh*T/t per token and key/value expanded to
    every query head, a*2(nh - nkv)*hd/t more, and no log-sum-exp.
    Outside the layers: the token ids, the position ids (learned positions) or the RoPE tables, the final norm's
    input and statistics, the LM head's input (not with the fused loss, which keeps gradients instead).
    """
    H, hd, F, L = m.d_model, m.head_dim, m.ffn_dim, m.n_layers
    s = tp if sp and tp > 1 else 1
    autocast = precision == "bf16" and not fsdp
    a = _compute_bytes(precision)
    r = 4 if (precision == "fp32" or autocast) else 2

    def norm() -> float:  # input + statistics of one norm, per token
        if m.norm == "layernorm":
            return (r * H + 8) / s
        return (8 * H + 4) / s  # RMSNorm (composite, computed in fp32) keeps fp32 x, x * rstd and rstd

    nh, nkv = m.n_heads / tp, m.kv_heads / tp
    # Under SP without checkpointing, attention and MLP keep their input's sequence shard and gather it again in
    # backward (hybridpar/parallel/sequence_shard.py); so does the LM head whatever the checkpointing.
    shard = s if (ac == "none" and not autocast and not compile) else 1
    attn_in = a * H * (3 if autocast else 1) / shard
    mlp_in = a * H * (2 if (autocast and m.mlp == "swiglu") else 1) / shard
    inner = a * (4 if m.mlp == "swiglu" else 2) * F / tp
    scores = (4 * nh * seq_len + a * 2 * (nh - nkv) * hd - 4 * nh) if math_attention else 0  # (no log-sum-exp)
    layer = (2 * norm() + attn_in + a * (nh + 2 * nkv) * hd + a * nh * hd + 4 * nh + mlp_in + inner + scores) * tokens
    block_input = r * H / s * tokens
    # Which layers keep all of the above, and what the checkpointed ones keep instead.
    if ac == "full":
        ckpt = len(range(0, L, ac_every))
        kept_layers = (L - ckpt) * layer + ckpt * block_input
        recompute = layer  # backward re-runs one checkpointed block at a time
    elif ac == "selective":
        # Each branch's input (the residual stream, its sequence shard under SP), and the outputs of its linears
        # but the last (q, k, v; the MLP's first matmuls) and of fused attention (also the output projection's
        # input). The output and down projections' outputs are neither kept nor recomputed.
        kept = (2 * r * H / s + a * (nh + 2 * nkv) * hd + a * nh * hd + 4 * nh
                + a * (2 if m.mlp == "swiglu" else 1) * F / tp + (2 * a * H if fp8_blocks else 0)) * tokens
        # (fp8_blocks: torchao's float8 linears keep the output and down projections' outputs too: (tokens, H) each,
        # partial sums under TP)
        kept_layers = L * kept
        recompute = max(0, layer - kept)  # what one block recomputes in backward: norms, RoPE, activation, ...
    else:
        kept_layers, recompute = L * layer, 0
    outside = 8 * tokens  # token ids
    if m.position == "learned":
        outside += 8 * seq_len  # position ids
    elif ac == "none" or (ac == "full" and ac_every > 1):
        outside += 2 * m.max_seq_len * hd // 2 * 4  # the cos/sin tables the RoPE multiplies save (not recomputed)
    outside += norm() * tokens  # final norm
    if not fused_loss:
        outside += a * H * tokens / (1 if autocast else s)  # the LM head's input (its sequence shard under SP; the
        #                                                     fused loss keeps gradients instead: logits_bytes)
    out = {"layers": int(kept_layers), "outside_layers": int(outside), "recompute_peak": int(recompute)}
    if autocast:  # bf16 copies of the matmul weights (local TP shards), kept from forward to backward except in
        # fully checkpointed blocks, which cast them again when they recompute
        layer_w = sum(numel(s_.shape) for s_ in param_specs(m, range(1)) if s_.block == 0 and len(s_.shape) == 2)
        kept = L - (len(range(0, L, ac_every)) if ac == "full" else 0)
        out["autocast_weight_copies"] = 2 * (kept * layer_w // tp + chunk(m.vocab_size, tp, 0) * H)
    return out


def logits_bytes(m: ModelConfig, tokens: int, tp: int, precision: str, chunk_tokens: int = 0) -> int:
    """Peak bytes of the LM head + loss for one microbatch.

    Plain path (chunk_tokens 0, or tp > 1 with the vocab-parallel loss; vocab / tp per rank): the logits in the
    compute dtype, the loss's fp32 log-softmax and its gradient. Fused path (hybridpar's linear_cross_entropy,
    tp = 1): one chunk's fp32 logits and their compute-dtype gradient, the fp32 accumulator of the weight gradient
    and its compute-dtype copy, and the input gradient it keeps for backward.
    """
    a = _compute_bytes(precision)
    if chunk_tokens and tp == 1:
        V, H = m.vocab_size, m.d_model
        return min(chunk_tokens, tokens) * V * (4 + a) + V * H * (4 + a) + tokens * H * a
    return tokens * chunk(m.vocab_size, tp, 0) * (a + 8)


def microbatches(cfg: Config, layout: Layout) -> int:
    """Microbatches per optimizer step on each data-parallel rank."""
    t = cfg.train
    return t.global_batch_size // ((t.micro_batch_size or t.global_batch_size // layout.dp) * layout.dp)


def accumulates_unsharded(cfg: Config, layout: Layout) -> bool:
    """Whether FSDP holds gathered parameters and unsharded gradients between microbatches (parallel.
    accumulate_unsharded; "auto" counts as false here, the mode that always needs less: hybridpar.planning.layouts.
    choose_accumulation settles it for a device). False without FSDP or with one microbatch, where nothing is held."""
    value = cfg.parallel.accumulate_unsharded
    return value is True and uses_fsdp(cfg, layout.dp) and microbatches(cfg, layout) > 1


def accumulation_bytes(cfg: Config, layout: Layout, rank: int = 0) -> int:
    """Bytes a rank holds between two microbatches of a step, beyond its parameters and optimizer state.
    Unsharded accumulation: every FSDP group's gathered parameters (compute dtype) and unsharded gradients (fp32,
    FSDP's reduce dtype), i.e. (2 + 4) bytes per tensor-parallel-local parameter in bf16 and (4 + 4) in fp32.
    Otherwise: the sharded fp32 gradients the microbatches accumulate into (under HSDP, FSDP's partial
    reduce-scatter output of the same size), which the plan counts as grads_bytes_per_gpu. parallel.exact_reduction
    adds its int64 accumulator of the sharded gradients: (8 + 4) bytes per local parameter."""
    sizes = local_sizes(cfg.model, layout, rank)
    if cfg.parallel.exact_reduction:  # the int64 accumulator beside the (zero) fp32 gradients FSDP keeps
        return (8 + 4) * sizes.params
    if not accumulates_unsharded(cfg, layout):
        return 4 * sizes.params
    return (_compute_bytes(cfg.train.precision) + 4) * sizes.tp_params


def memory(cfg: Config, layout: Layout, rank: int = 0) -> dict:
    """Bytes per GPU of one rank, by part. Parameters are kept in fp32 (bf16 is a compute dtype), gradients in
    fp32 with the parameters' local shapes, AdamW state = two fp32 tensors per parameter + a 4-byte step count.
    Unsharded gradient accumulation adds the whole tensor-parallel-local model's gathered parameters and fp32
    gradients (accumulation_bytes_per_gpu; 0 otherwise; parallel.exact_reduction's int64 accumulator there)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    sizes = local_sizes(m, layout, rank)
    params = 4 * sizes.params
    fsdp = uses_fsdp(cfg, layout.dp)
    bf16 = t.precision == "bf16"
    micro = t.micro_batch_size or t.global_batch_size // layout.dp
    tokens = micro * t.seq_len
    fused = bool(t.loss_chunk_tokens) and layout.tp == 1
    # On CUDA, fp32 grouped-query attention has no fused kernel (flash needs 16-bit inputs; the memory-efficient
    # kernel takes no GQA): SDPA falls back to the math kernel
    math_attention = (t.precision or "fp32") == "fp32" and m.kv_heads < m.n_heads
    acts = activation_bytes(m, tokens, t.seq_len, layout.tp, p.sequence_parallel, t.precision or "fp32", fsdp,
                            t.activation_checkpointing, t.ac_every, fused, t.compile, math_attention, t.fp8 != "off")
    between = accumulation_bytes(cfg, layout, rank)
    buffers = 0
    if fsdp:
        pb = _compute_bytes(t.precision)
        block, root = sizes.tp_block, sizes.tp_root
        reshard = reshard_after_forward(p)
        held = m.n_layers if reshard is False else min(m.n_layers, 1 + p.fsdp_prefetch)
        # unsharded parameters of the blocks in flight and of the root (kept from forward to backward), one
        # block's unsharded gradient, and its fp32 reduce-scatter input when computing in bf16; resharding to N
        # ranks keeps every block's 1/N piece from its forward to its backward
        kept = 0 if isinstance(reshard, bool) else m.n_layers * math.ceil(block / reshard)
        buffers = pb * (held * block + root + kept) + pb * block + (4 * block if bf16 else 0)
        if p.exact_reduction:  # a block's reduce-scatter input quantized to int64
            buffers += 8 * block
    out = {
        "params_bytes_per_gpu": params,
        "grads_bytes_per_gpu": params,
        "optimizer_bytes_per_gpu": optimizer_bytes(cfg, layout, rank),
        "activations_bytes_per_gpu": sum(acts.values()),
        "activations": acts,
        "logits_bytes_per_gpu": logits_bytes(m, tokens, layout.tp, t.precision or "fp32", t.loss_chunk_tokens),
        "fsdp_buffers_bytes_per_gpu": buffers,
        # (parallel.exact_reduction: its int64 accumulator, beside the gradients FSDP keeps)
        "accumulation_bytes_per_gpu": between if accumulates_unsharded(cfg, layout) else
        8 * sizes.params if p.exact_reduction else 0,
        "between_microbatches_bytes_per_gpu": between,
    }
    on_gpu = ["activations_bytes_per_gpu", "logits_bytes_per_gpu", "fsdp_buffers_bytes_per_gpu",
              "accumulation_bytes_per_gpu"]
    if not (fsdp and p.fsdp_cpu_offload):
        on_gpu += ["params_bytes_per_gpu", "grads_bytes_per_gpu", "optimizer_bytes_per_gpu"]
    out["total_bytes_per_gpu"] = sum(out[k] for k in on_gpu)
    return out


def optimizer_bytes(cfg: Config, layout: Layout, rank: int = 0) -> int:
    """AdamW: two fp32 moments per parameter and a 4-byte step per tensor; Muon's matrices: one fp32 buffer."""
    sizes = local_sizes(cfg.model, layout, rank)
    numel_, n_tensors = sizes.params, sizes.tensors
    hidden = sizes.hidden if cfg.optim.name == "muon" else ()
    muon = sum(held for _, held in hidden)
    return 4 * muon + 8 * (numel_ - muon) + 4 * (n_tensors - len(hidden))


def muon_share(cfg: Config, layout: Layout, rank: int = 0) -> dict:
    """Newton-Schulz FLOPs and all-to-all bytes (sent, = received) of this rank's share of a Muon step: matrix j of
    a shard group of dp_shard x tp ranks is owned by member j mod n, member (shard, tp) being shard * tp + tp_rank
    (hybridpar.training.muon.owner_share); distribution=gather: every matrix, all-gathered."""
    from hybridpar.training.muon import owner_share

    if cfg.optim.name != "muon":
        return {"muon_ns_flops": 0, "muon_comm_bytes": 0}
    hidden, (_, shard, tp_rank) = local_sizes(cfg.model, layout, rank).hidden, layout.coords(rank)
    return owner_share([shape for shape, _ in hidden], [held for _, held in hidden], layout.dp_shard * layout.tp,
                       shard * layout.tp + tp_rank, cfg.optim.muon_ns_steps, cfg.optim.muon_distribution == "gather")


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
    """Seconds of FSDP link time `comm` that a step with `compute` seconds of compute does not hide."""
    return max(FSDP_EXPOSED_SHARE * comm, comm - compute)


def gemm_efficiency(tokens: int, d_model: int) -> float:
    """Model FLOPs / peak for GEMMs of `tokens` rows in layers `d_model` wide: GEMM_EFFICIENCY x width / (width +
    GEMM_HALF_WIDTH) x token_curve(tokens)."""
    return GEMM_EFFICIENCY * d_model / (d_model + GEMM_HALF_WIDTH) * token_curve(tokens)


def all_gather_bytes(cfg: Config, layout: Layout) -> int:
    """Bytes of one FSDP all-gather of the whole model by a TP rank (its tp shard of every parameter): the compute
    dtype's, or 1 byte for the weights train.fp8=tensorwise all-gathers in float8 (train.fp8_all_gather)."""
    t, sizes = cfg.train, local_sizes(cfg.model, layout)
    a = _compute_bytes(t.precision)
    if t.fp8 != "tensorwise" or not t.fp8_all_gather:
        return sizes.tp_params * a
    fp8 = sizes.tp_hidden + (sizes.tp_head if t.fp8_linears == "all" else 0)
    return fp8 + (sizes.tp_params - fp8) * a


def root_gather_bytes(cfg: Config, layout: Layout) -> int:
    """The part of all_gather_bytes that is the root's (embeddings, final norm, LM head): FSDP keeps the root's
    parameters gathered from its forward to its backward, so it gathers them once a forward, the blocks twice."""
    sizes, t, a = local_sizes(cfg.model, layout), cfg.train, _compute_bytes(cfg.train.precision)
    if t.fp8 == "tensorwise" and t.fp8_all_gather and t.fp8_linears == "all":
        return sizes.tp_root * a - (a - 1) * sizes.tp_head
    return sizes.tp_root * a


def step_time(cfg: Config, layout: Layout, gpu: GPU, gpus_per_node: int) -> dict:
    """Estimated seconds of one optimizer step, by part.

    compute: model FLOPs, plus the recomputed forward of each fully checkpointed block up to its down projection
      (selective checkpointing recomputes no matmul), at gemm_efficiency(micro-batch tokens, d_model) of the peak;
      with tp > 1, TP_COMPUTE_PENALTY longer (compute_at_peak_s: the same FLOPs at the peak).
    tp: per layer and microbatch, 2 all-reduces forward and 2 backward of the (tokens, H) activations (reduce-
      scatter + all-gather under SP: the same bytes), plus the recomputed forward's 2, plus under SP the all-gathers
      of inputs kept as sequence shards (2 per block, 1 for the LM head); over NVLink; not overlapped.
    fsdp: all-gathers of the bf16 parameters and fp32 reduce-scatters of the gradients: with unsharded
      accumulation (or one microbatch) forward gathers once, backward once per microbatch with full_shard, and
      one reduce-scatter per step; with sharded accumulation every microbatch gathers in forward (and in backward
      with full_shard) and reduce-scatters; the root (embeddings, final norm, LM head), kept gathered from forward
      to backward, is gathered once a step or once a microbatch (fsdp_gather_bytes, fsdp_scatter_bytes: the
      step's totals, full-tensor sizes, as measured on ranks in tests/test_parallel.py); with HSDP one fp32
      all-reduce of the gradient shards across replicas; parallel.exact_reduction reduce-scatters every
      microbatch and all-reduces across replicas in int64 (8 bytes an element; its per-step MAX of one float64 per
      parameter tensor and the grad norm's few scalars are not counted);
      over NVLink when the group fits in a node, else the per-GPU inter-node link; FSDP_EXPOSED_SHARE of it is not
      hidden by compute (all of what exceeds compute).
    fp8 (train.fp8): the converted linears' FLOPs (the blocks', and the LM head's with fp8_linears=all) at the
      float8 peak, the rest at bf16's, both at gemm_efficiency (the casts and scales are not counted: an upper bound
      until measured on a GPU); tensorwise with fp8_all_gather all-gathers those weights in 1 byte.
    optimizer: AdamW streams 28 bytes per local parameter (read p, g, m, v; write p, m, v) through HBM, Muon's
      matrices 20; Muon's Newton-Schulz FLOPs of rank 0's share (it owns the most matrices) at gemm_efficiency
      of the bf16 peak, and its two all-to-alls over NVLink when the shard group fits in a node; not overlapped.
    per-microbatch overhead: kernel launches and FSDP hooks, per block and microbatch.
    selective recompute: what a selectively checkpointed block recomputes (norms, RoPE, the activation: no matmul)
      streamed twice through HBM (read, write) per block and microbatch.
    """
    m, t, p = cfg.model, cfg.train, cfg.parallel
    micro = t.micro_batch_size or t.global_batch_size // layout.dp
    n_micro = microbatches(cfg, layout)
    tokens_rank = t.global_batch_size * t.seq_len / layout.dp  # tokens of this rank's TP group per step
    parts = flops_parts(m, t.seq_len)
    fpt = sum(parts.values())
    ckpt = len(range(0, m.n_layers, t.ac_every)) if t.activation_checkpointing == "full" else 0
    # a fully checkpointed block recomputes its forward up to the down projection's input: recomputation stops once
    # backward has what it needs (measured with FlopCounterMode: tests/test_activation_checkpointing.py)
    block_forward = (parts["blocks"] + parts["attention"]) / m.n_layers / 3
    recompute = 1 + ckpt * (block_forward - 2 * m.d_model * m.ffn_dim) / fpt
    fp8 = t.fp8 != "off" and gpu.peak_fp8_tflops > 0
    fp8_share = (parts["blocks"] + (parts["head"] if t.fp8_linears == "all" else 0)) / fpt if fp8 else 0.0
    per_flop = (1 - fp8_share) / gpu.peak_tflops + fp8_share / (gpu.peak_fp8_tflops if fp8 else 1.0)
    work = fpt * tokens_rank / layout.tp * recompute * per_flop / 1e12  # seconds at the peak
    compute = work / gemm_efficiency(micro * t.seq_len, m.d_model) * (1 + TP_COMPUTE_PENALTY if layout.tp > 1 else 1)
    a = _compute_bytes(t.precision)
    act = micro * t.seq_len * m.d_model * a
    # under SP, inputs kept as sequence shards are all-gathered again in backward (attention and MLP of blocks not
    # fully checkpointed, and the LM head): half an all-reduce each
    # (selective checkpointing recomputes them; under compile without checkpointing the blocks keep their inputs
    # gathered, so only the LM head's)
    ac = t.activation_checkpointing
    blocks_regather = m.n_layers if ac == "selective" or (ac == "none" and not t.compile) else 0
    regather = (2 * blocks_regather + 1) * 0.5 if p.sequence_parallel else 0
    per_micro = (4 * m.n_layers + 2 * ckpt + 2 + regather) * _ring(act, layout.tp, gpu.nvlink_gbps, all_reduce=True)
    tp_comm = n_micro * per_micro
    fsdp = hsdp = exposed = 0.0
    gathered = all_gather_bytes(cfg, layout)
    gather_bytes = scatter_bytes = 0
    if layout.dp > 1:
        params_tp = local_sizes(m, layout).tp_params
        shard_bw = gpu.nvlink_gbps if layout.dp_shard * layout.tp <= gpus_per_node else gpu.internode_gbps
        reshard = reshard_after_forward(p)
        root = root_gather_bytes(cfg, layout)
        blocks = gathered - root
        # the blocks' gathers (forward, and backward when resharded after forward); the root's, once a forward
        if n_micro == 1 or accumulates_unsharded(cfg, layout):
            gathers, root_gathers, scatters = 1 + (n_micro if reshard is True else 0), 1, 1
        else:
            gathers, root_gathers, scatters = n_micro * (2 if reshard is True else 1), n_micro, n_micro
        grad_bytes = 8 if p.exact_reduction else 4  # (the mode reduces int64: hybridpar.parallel.exact)
        gather_bytes, scatter_bytes = gathers * blocks + root_gathers * root, scatters * params_tp * grad_bytes
        fsdp = _ring(gather_bytes, layout.dp_shard, shard_bw) + _ring(scatter_bytes, layout.dp_shard, shard_bw)
        if not isinstance(reshard, bool):  # backward's all-gathers of the blocks within groups of N ranks
            group_bw = gpu.nvlink_gbps if reshard * layout.tp <= gpus_per_node else gpu.internode_gbps
            fsdp += n_micro * _ring(blocks, reshard, group_bw)
            gathers += n_micro
        rep_bw = gpu.nvlink_gbps if layout.world <= gpus_per_node else gpu.internode_gbps
        hsdp = _ring(params_tp * grad_bytes / layout.dp_shard, layout.dp_replicate, rep_bw, all_reduce=True)
        exposed = exposed_fsdp(fsdp + hsdp, compute)
    params_local = local_sizes(m, layout).params
    optimizer = 28 * params_local / (gpu.hbm_gbps * 1e9)
    muon = muon_share(cfg, layout)  # rank 0: member 0 owns the most matrices
    muon_ns = muon["muon_ns_flops"] / (gpu.peak_tflops * 1e12 * gemm_efficiency(GEMM_FULL_RATE_TOKENS, m.d_model))
    muon_bw = gpu.nvlink_gbps if layout.dp_shard * layout.tp <= gpus_per_node else gpu.internode_gbps
    muon_comm = muon["muon_comm_bytes"] / (muon_bw * 1e9 * LINK_EFFICIENCY)
    if cfg.optim.name == "muon":  # its matrices stream 20 bytes (read p, g, b; write p, b), not AdamW's 28
        optimizer -= 8 * sum(held for _, held in local_sizes(m, layout).hidden) / (gpu.hbm_gbps * 1e9)
    # selective checkpointing recomputes no matmul, but its norms, RoPE and activation: memory-bound, timed as
    # their outputs written and inputs read once more through HBM
    recompute_s = 0.0
    if t.activation_checkpointing == "selective":
        redo = activation_bytes(m, micro * t.seq_len, t.seq_len, layout.tp, p.sequence_parallel,
                                t.precision or "fp32", uses_fsdp(cfg, layout.dp), "selective",
                                fp8_blocks=t.fp8 != "off")["recompute_peak"]
        recompute_s = n_micro * m.n_layers * 2 * redo / (gpu.hbm_gbps * 1e9)
    kernels = KERNELS_PER_BLOCK["modern" if m.position == "rope" or m.mlp == "swiglu" else "gpt2"]
    overhead = n_micro * m.n_layers * (kernels * LAUNCH_S + (FSDP_HOOKS_S if uses_fsdp(cfg, layout.dp) else 0.0))
    total = compute + recompute_s + tp_comm + exposed + optimizer + muon_ns + muon_comm + overhead
    return {"step_time_s": total, "compute_s": compute, "compute_at_peak_s": work,
            "selective_recompute_s": recompute_s, "tp_comm_s": tp_comm,
            "fsdp_comm_s": fsdp + hsdp,
            "fsdp_exposed_s": exposed, "optimizer_s": optimizer, "muon_ns_s": muon_ns, "muon_comm_s": muon_comm,
            "per_microbatch_overhead_s": overhead,
            "tokens_per_sec": t.global_batch_size * t.seq_len / total,
            "mfu": fpt * t.global_batch_size * t.seq_len / total / layout.world / (gpu.peak_tflops * 1e12),
            "mfu_fp8": (fpt * t.global_batch_size * t.seq_len / total / layout.world / (gpu.peak_fp8_tflops * 1e12)
                        if fp8 else None), "all_gather_bytes": gathered,
            "fsdp_gather_bytes": gather_bytes, "fsdp_scatter_bytes": scatter_bytes}
