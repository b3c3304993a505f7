"""KempnerForge's published H200 sweep, each row planned with the recipe it was run with (the time model's fit over
this and other frameworks' runs is tests/published_frameworks.py's). `python tests/published_runs.py` prints the
table of docs/planning.md.

KempnerForge's H200 sweep (KempnerInstitute/KempnerForge, benchmarks/mfu_scaling/mfu_scaling.md, dated 2026-04-05):
Llama-3-shaped models (vocab 128,256 untied, GQA with 8 key/value heads, SwiGLU, RMSNorm, RoPE), sequence 4096,
bf16, full activation checkpointing, torch.compile (not row 8), fused AdamW, 4 H200 per node over NVLink, nodes over
InfiniBand; micro-batch and accumulation per row from its benchmarks/mfu_scaling/mfu_bench.sh. "Mem/GPU" is
torch.cuda.max_memory_allocated in GiB (its kempnerforge/metrics/memory.py divides by 1024**3).

What that recipe holds that hybridpar's does not, read from the same repository's source, so that a published row
is planned as it ran (published_memory()):
- weights, gradients and AdamW moments in bf16: the model is cast with model.to(bf16) (kempnerforge/distributed/
  parallel.py), 8 bytes a parameter: hybridpar's optim.master_dtype=bf16 and optim.state_dtype=bf16 (config(),
  lean), where its default keeps fp32 master weights, gradients and moments, 16;
- under TP the LM head's logits are all-gathered to every rank (ColwiseParallel with a Replicate output) and the
  loss is F.cross_entropy on bf16 logits: bf16 logits, log-softmax and gradient over the whole vocabulary, plus the
  local shard before the gather; hybridpar's loss is vocabulary-parallel (vocab / tp per rank, fp32 softmax);
- the token embedding is replicated across TP ranks (hybridpar's is vocabulary-parallel);
- gradient accumulation with FSDP skips the reduce-scatter of all but the last microbatch
  (set_requires_gradient_sync(False), kempnerforge/training/grad.py): FSDP2 keeps the unsharded gradient of every
  TP-local parameter, in its fp32 reduce dtype, from the first microbatch to the last; parameters are resharded
  after each forward and backward, so every microbatch gathers them twice, and the step reduce-scatters once.
The rest (activations, FSDP's buffers) is hybridpar's own model of its block, which the published block matches in
shape. On one GPU the recipe applies no FSDP, so it has no FSDP buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.config import Config
from hybridpar.config.cli import load_config
from hybridpar.planning.cost import GIB, GPUS, _ring, all_gather_bytes, exposed_fsdp, memory, plan_of, step_time
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.shapes import local_param_count

SOURCE = "KempnerForge mfu_scaling.md (2026-04-05), H200, 4 GPUs per node"
GPUS_PER_NODE = 4
SEQ = 4096
VOCAB = 128256


@dataclass(frozen=True)
class Row:
    """One published measurement: the layout it ran and what it measured."""
    n: int
    model: str
    tp: int
    dp_shard: int
    micro: int
    accumulation: int
    compile: bool
    step_s: float
    memory_gib: float
    tokens_per_s: int  # as published (all GPUs): tests check it against the step time and batch transcribed here

    @property
    def gpus(self) -> int:
        return self.tp * self.dp_shard


# Llama-3-shaped models as published (d_model, layers, heads; FFN width: 256 * ceil(4 d * 2/3 * 1.3 / 256) for 7B
# and 13B, given for 70B), as hybridpar model arguments
MODELS = {
    "7B": ["--model.name", "gpt-modern-7b"],
    "13B": ["--model.name", "gpt-modern-13b", "--model.ffn_hidden_size", "17920"],
    "70B": ["--model.name", "gpt-modern-7b", "--model.n_layers", "80", "--model.d_model", "8192",
            "--model.n_heads", "64", "--model.ffn_hidden_size", "28672"],
}

ROWS = [
    Row(1, "7B", 1, 1, 2, 4, True, 3.13, 80.7, 10471),
    Row(2, "7B", 1, 2, 2, 4, True, 3.50, 62.4, 18728),
    Row(3, "7B", 2, 1, 4, 2, True, 2.49, 57.8, 13163),
    Row(4, "7B", 1, 4, 4, 2, True, 3.36, 61.1, 38983),
    Row(5, "7B", 4, 1, 4, 2, True, 1.30, 39.4, 25135),
    Row(6, "7B", 2, 2, 4, 2, True, 2.52, 45.9, 25980),
    Row(7, "7B", 4, 2, 4, 2, True, 1.48, 32.7, 44299),
    Row(8, "13B", 1, 8, 4, 4, False, 14.81, 88.5, 35405),
    Row(9, "13B", 4, 2, 4, 4, True, 4.79, 45.1, 27345),
    Row(10, "7B", 4, 4, 4, 2, True, 1.58, 29.4, 82988),
    Row(11, "13B", 4, 4, 4, 4, True, 4.87, 39.2, 53814),
    Row(12, "7B", 4, 8, 4, 2, True, 1.68, 27.6, 155917),
    Row(13, "13B", 4, 8, 4, 4, True, 5.03, 36.3, 104309),
    Row(14, "70B", 4, 8, 2, 4, True, 14.85, 93.2, 17657),
]


LEAN = ["--optim.master_dtype", "bf16", "--optim.state_dtype", "bf16"]  # the recipe's 8 bytes a parameter


def config(row: Row, lean: bool = True) -> Config:
    """hybridpar's config of a published row's model and layout (full checkpointing, bf16, sequence parallel) with
    the recipe's bf16 weights, gradients and moments (lean), or hybridpar's fp32 masters and moments."""
    return load_config(MODELS[row.model] + (LEAN if lean else []) + [
        "--model.vocab_size", str(VOCAB), "--model.max_seq_len", str(SEQ), "--train.seq_len", str(SEQ),
        "--train.precision", "bf16", "--train.micro_batch_size", str(row.micro),
        "--train.global_batch_size", str(row.micro * row.accumulation * row.dp_shard),
        "--train.activation_checkpointing", "full", "--train.compile", str(row.compile).lower(),
        "--parallel.tp", str(row.tp), "--parallel.dp_shard", str(row.dp_shard),
        "--parallel.sequence_parallel", "true"])


def published_memory(cfg: Config, row: Row) -> dict[str, int]:
    """Bytes per GPU of a published row under its own recipe (the module's docstring), by part."""
    plan = memory(plan_of(cfg, Layout(1, row.dp_shard, row.tp)))
    m, tokens = cfg.model, row.micro * SEQ
    embedding = m.vocab_size * m.d_model
    # replicated across TP ranks, sharded by FSDP: the (tp - 1) / tp of it hybridpar's plan does not hold
    replicated = embedding * (row.tp - 1) // row.tp // row.dp_shard
    state = plan["params_bytes_per_gpu"] + plan["grads_bytes_per_gpu"] + plan["optimizer_bytes_per_gpu"]
    logits = tokens * m.vocab_size * 3 * 2 + (tokens * m.vocab_size // row.tp * 2 if row.tp > 1 else 0)
    tp_local = local_param_count(m, Layout(1, 1, row.tp))[0] + embedding * (row.tp - 1) // row.tp
    unsharded_grads = 4 * tp_local if row.dp_shard > 1 and row.accumulation > 1 else 0
    return {"state": state + 8 * replicated, "activations": plan["activations_bytes_per_gpu"], "logits": logits,
            "fsdp_buffers": plan["fsdp_buffers_bytes_per_gpu"] if row.gpus > 1 else 0,
            "unsharded_gradients": unsharded_grads}


def recipe_fsdp_seconds(cfg: Config, layout: Layout, accumulation: int, gpu: str = "h200",
                        gpus_per_node: int = GPUS_PER_NODE) -> float:
    """FSDP's link time in a step of KempnerForge's recipe, its schedule as the module's docstring says: every
    microbatch all-gathers the TP-local bf16 parameters (the replicated embedding whole) in forward and in backward,
    the step reduce-scatters their fp32 gradients once; over NVLink inside a node, else the inter-node link."""
    if layout.dp_shard == 1:
        return 0.0
    m, link = cfg.model, GPUS[gpu]
    replicated = m.vocab_size * m.d_model * (layout.tp - 1) // layout.tp
    gathered = all_gather_bytes(plan_of(cfg, layout)) + 2 * replicated
    params = local_param_count(m, Layout(1, 1, layout.tp))[0] + replicated
    bw = link.nvlink_gbps if layout.world <= gpus_per_node else link.internode_gbps
    return _ring(2 * accumulation * gathered, layout.dp_shard, bw) + _ring(4 * params, layout.dp_shard, bw)


def published_fsdp_seconds(cfg: Config, row: Row) -> float:
    """recipe_fsdp_seconds of a row of the sweep."""
    return recipe_fsdp_seconds(cfg, Layout(1, row.dp_shard, row.tp), row.accumulation)


def published_step(cfg: Config, row: Row) -> float:
    """A published row's step time as planned: hybridpar's time model with the row's FSDP schedule."""
    s = step_time(plan_of(cfg, Layout(1, row.dp_shard, row.tp)), GPUS["h200"], GPUS_PER_NODE)
    return s["step_time_s"] - s["fsdp_exposed_s"] + exposed_fsdp(published_fsdp_seconds(cfg, row), s["compute_s"])


# One more measurement the fit takes: a plain GPT-3 1.3B training loop (micro-batch 8 x 2048, bf16, compiled, no
# checkpointing) on one H200 ran 60.9k tokens/s (hybridpar's issue 8; the figure cost.py's constants first came from)
REFERENCE_1_3B = (["--model.name", "gpt3-1.3b", "--model.vocab_size", "50304", "--train.seq_len", "2048",
                   "--train.global_batch_size", "8", "--train.micro_batch_size", "8", "--train.precision", "bf16",
                   "--train.compile", "true"], 8 * 2048 / 60.9e3)


def compare() -> list[dict]:
    """Every published row beside its plans: step time (hybridpar's time model for the row's layout), memory
    under the published recipe and under hybridpar's own (what hybridpar would hold running that layout)."""
    out = []
    for row in ROWS:
        cfg, layout = config(row), Layout(1, row.dp_shard, row.tp)
        step = published_step(cfg, row)
        theirs = sum(published_memory(cfg, row).values()) / GIB
        ours = memory(plan_of(config(row, lean=False), layout))["total_bytes_per_gpu"] / GIB
        out.append({"row": row, "step_s": step, "step_error": step / row.step_s - 1, "memory_gib": theirs,
                    "memory_error": theirs / row.memory_gib - 1, "hybridpar_memory_gib": ours})
    return out


def table() -> str:
    """The markdown table docs/planning.md carries (tests/test_plan.py keeps it equal to this)."""
    lines = ["| row | model | layout (GPUs) | micro x accumulation | step: measured / planned | memory GiB: measured / "
             "planned, published recipe | hybridpar's own recipe, GiB |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in compare():
        r = c["row"]
        layout = " x ".join(p for p in (f"TP {r.tp}" if r.tp > 1 else "", f"FSDP {r.dp_shard}" if r.dp_shard > 1
                                         else "") if p) or "one GPU"
        lines.append(f"| {r.n} | {r.model} | {layout} ({r.gpus}) | {r.micro} x {r.accumulation} | {r.step_s:.2f} s / "
                     f"{c['step_s']:.2f} s ({c['step_error']:+.0%}) | {r.memory_gib:.1f} / {c['memory_gib']:.1f} "
                     f"({c['memory_error']:+.0%}) | {c['hybridpar_memory_gib']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
