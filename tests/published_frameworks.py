"""Published training runs of other frameworks, transcribed as each framework's repository states them, to plan
out of sample: the planner's constants are fitted to KempnerForge's H200 sweep and the 1.3B reference
(tests/published_runs.py) and to nothing here. `python tests/published_frameworks.py` prints, per row, the
measured and planned tokens/s per GPU and memory, and the error.

Sources (each row's `source`):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama-3 8B (32 x 4096, 32 heads, 8 KV, FFN 14,336,
  vocab 128,256), seq 8192, H100 96 GB HBM2e at a 500 W cap, selective AC, bf16 FSDP (fp32 master weights).
- torchao, docs/source/workflows/training.md: the same 8B on 8 H100, FSDP 8, micro 1, seq 8192, compile, per-op
  selective AC, bf16.
- llm-foundry, scripts/train/benchmarking/README.md: MPT models (GPT-shaped: multi-head attention, GELU 4x MLP,
  vocab 50,368), seq 2048, 80 GB H100, FSDP FULL_SHARD with bf16 parameters.
- KempnerForge, benchmarks/weak_scaling_160gpu/README.md: H200, seq 4096, full AC, compile, its bf16 recipe (weights,
  gradients and moments in bf16: tests/published_runs.py's docstring), TP 4 x FSDP 2 / 8 / 40.
- nanotron: Llama-1B on 8 H100, seq 4096, data parallelism without FSDP x TP. The shape is not in the row as given
  to us; Llama-3.2-1B's (16 x 2048, 32 heads, 8 KV, FFN 8192, vocab 128,256, tied) is assumed.

What hybridpar cannot run as published is said in `recipe`: "hybridpar" rows run hybridpar's own numerics (fp32
master weights, bf16 compute), so their memory is comparable; "bf16" rows hold weights, gradients and moments in
bf16 (8 bytes a parameter), which hybridpar has no option for yet (optim.state_dtype=bf16 holds 12): their memory is
reported, not compared.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.config.cli import load_config
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.cost import GIB, GPUS, memory, plan_of, step_time

LLAMA3_8B = ["--model.name", "gpt-modern-7b", "--model.n_kv_heads", "8", "--model.vocab_size", "128256"]
LLAMA32_1B = ["--model.name", "gpt-modern-1b", "--model.n_kv_heads", "8", "--model.vocab_size", "128256",
              "--model.tie_embeddings", "true"]
MPT = ["--model.name", "gpt2-124m", "--model.vocab_size", "50368"]
SHAPES = {
    "llama3-8b": LLAMA3_8B,
    "llama3.2-1b": LLAMA32_1B,
    "mpt-1b": [*MPT, "--model.n_layers", "24", "--model.d_model", "2048", "--model.n_heads", "16"],
    "mpt-7b": [*MPT, "--model.n_layers", "32", "--model.d_model", "4096", "--model.n_heads", "32"],
    "mpt-13b": [*MPT, "--model.n_layers", "40", "--model.d_model", "5120", "--model.n_heads", "40"],
    "mpt-70b": [*MPT, "--model.n_layers", "80", "--model.d_model", "8192", "--model.n_heads", "64"],
    "kf-13b": ["--model.name", "gpt-modern-13b", "--model.ffn_hidden_size", "17920", "--model.vocab_size", "128256"],
    "kf-70b": ["--model.name", "gpt-modern-7b", "--model.n_layers", "80", "--model.d_model", "8192",
               "--model.n_heads", "64", "--model.ffn_hidden_size", "28672", "--model.vocab_size", "128256"],
}
UNITS = {"GiB": 1.0, "GB": 1e9 / GIB, "MiB": 2 ** 20 / GIB}


@dataclass(frozen=True)
class Published:
    framework: str
    source: str
    model: str  # a SHAPES key
    gpu: str  # a hybridpar.planning.cost.GPUS key (the nearest: a 96 GB H100 at 500 W is planned as an H100)
    tp: int
    dp_shard: int
    dp_replicate: int
    micro: int
    accumulation: int | None  # None: not given (the row is transcribed, not planned)
    seq: int
    ac: str  # none | selective | full
    compile: bool
    recipe: str  # hybridpar | bf16 (the module docstring)
    tokens_per_gpu_s: float | None  # as published, or None where a step time is
    step_s: float | None
    memory: float | None
    unit: str = "GiB"

    @property
    def gpus(self) -> int:
        return self.tp * self.dp_shard * self.dp_replicate

    @property
    def measured_tokens_per_gpu_s(self) -> float:
        if self.tokens_per_gpu_s is not None:
            return self.tokens_per_gpu_s
        return self.micro * self.accumulation * self.dp_shard * self.dp_replicate * self.seq / self.step_s / self.gpus


TT, TAO = "torchtitan", "torchao"
TT_SRC, TAO_SRC = "benchmarks/llama3_h100_202412_torchtitan.md", "docs/source/workflows/training.md"
LF, LF_SRC = "llm-foundry", "scripts/train/benchmarking/README.md"
KF, KF_SRC = "KempnerForge", "benchmarks/weak_scaling_160gpu/README.md"
NT, NT_SRC = "nanotron", "Llama-1B on 8 H100 (as given in hybridpar's issue 58)"
ROWS = [
    Published(TT, TT_SRC, "llama3-8b", "h100", 1, 8, 1, 2, 1, 8192, "selective", False, "hybridpar", 5762, None, 82.4),
    Published(TT, TT_SRC, "llama3-8b", "h100", 1, 8, 1, 2, 1, 8192, "selective", True, "hybridpar", 6667, None, 77.0),
    Published(TT, TT_SRC, "llama3-8b", "h100", 1, 128, 1, 2, 1, 8192, "selective", False, "hybridpar", 5605, None,
              67.0),
    Published(TT, TT_SRC, "llama3-8b", "h100", 1, 128, 1, 2, 1, 8192, "selective", True, "hybridpar", 6514, None, 62.0),
    Published(TAO, TAO_SRC, "llama3-8b", "h100", 1, 8, 1, 1, 1, 8192, "selective", True, "hybridpar", 6150, None,
              47.65, "GB"),
    Published(LF, LF_SRC, "mpt-1b", "h100", 1, 8, 1, 14, 1, 2048, "none", False, "bf16", 45455, None, None),
    Published(LF, LF_SRC, "mpt-7b", "h100", 1, 8, 1, 6, 1, 2048, "none", False, "bf16", 10643, None, None),
    Published(LF, LF_SRC, "mpt-13b", "h100", 1, 8, 1, 2, 1, 2048, "none", False, "bf16", 4792, None, None),
    Published(LF, LF_SRC, "mpt-70b", "h100", 1, 128, 1, 8, 1, 2048, "full", False, "bf16", 1058, None, None),
    # (micro x accumulation not in the weak-scaling rows as given: the mfu sweep's for the model at TP 4, assumed)
    # ("GB" there is torch's max_memory_allocated / 1024**3: GiB, as tests/published_runs.py's docstring reads it)
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 2, 1, 4, 4, 4096, "full", True, "bf16", None, 4.39, 45.0),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 8, 1, 4, 4, 4096, "full", True, "bf16", None, 4.75, 36.2),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 40, 1, 4, 4, 4096, "full", True, "bf16", None, 4.91, 33.9),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 2, 1, 2, 4, 4096, "full", True, "bf16", None, 18.09, 128.5),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 8, 1, 2, 4, 4096, "full", True, "bf16", None, 14.03, 93.2),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 40, 1, 2, 4, 4096, "full", True, "bf16", None, 15.32, 82.9),
    Published(NT, NT_SRC, "llama3.2-1b", "h100", 4, 1, 2, 8, None, 4096, "none", False, "hybridpar", None, 18.9,
              25808, "MiB"),
    Published(NT, NT_SRC, "llama3.2-1b", "h100", 2, 1, 4, 8, None, 4096, "none", False, "hybridpar", None, 15.8,
              43651, "MiB"),
]


def config(row: Published):
    """hybridpar's config of a row: its model, batch, sequence, checkpointing and compile, in bf16."""
    dp = row.dp_shard * row.dp_replicate
    return load_config([
        *SHAPES[row.model], "--model.max_seq_len", str(row.seq), "--train.seq_len", str(row.seq),
        "--train.precision", "bf16", "--train.micro_batch_size", str(row.micro),
        "--train.global_batch_size", str(row.micro * row.accumulation * dp),
        "--train.activation_checkpointing", row.ac, "--train.compile", str(row.compile).lower(),
        "--parallel.tp", str(row.tp), "--parallel.dp_shard", str(row.dp_shard),
        "--parallel.dp_replicate", str(row.dp_replicate), "--parallel.sequence_parallel", str(row.tp > 1).lower()])


def planned(row: Published) -> dict:
    """Today's planner on a row: tokens/s per GPU and hybridpar's memory, with their errors against the row."""
    cfg = config(row)
    plan = plan_of(cfg, Layout(row.dp_replicate, row.dp_shard, row.tp))
    per_node = 4 if row.gpu == "h200" else 8  # (KempnerForge's nodes hold 4 H200; the others' 8)
    s = step_time(plan, GPUS[row.gpu], per_node)
    tps = s["tokens_per_sec"] / row.gpus
    gib = memory(plan)["total_bytes_per_gpu"] / GIB
    measured = row.memory * UNITS[row.unit] if row.memory is not None else None
    return {"tokens_per_gpu_s": tps, "speed_error": tps / row.measured_tokens_per_gpu_s - 1, "memory_gib": gib,
            "measured_gib": measured,
            "memory_error": gib / measured - 1 if measured is not None and row.recipe == "hybridpar" else None}


def table() -> str:
    lines = ["| framework | model | GPUs (tp x dp_shard x dp_replicate) | micro x accum, seq | AC, compile | tokens/s "
             "per GPU: measured / planned | memory GiB: measured / planned (hybridpar's recipe) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in ROWS:
        if r.accumulation is None:
            lines.append(f"| {r.framework} | {r.model} | {r.gpus} ({r.tp} x {r.dp_shard} x {r.dp_replicate}) | "
                         f"{r.micro} x ?, {r.seq} | - | not planned: the row gives no gradient accumulation | - |")
            continue
        p = planned(r)
        mem = "-" if p["measured_gib"] is None else f"{p['measured_gib']:.1f}"
        err = f" ({p['memory_error']:+.0%})" if p["memory_error"] is not None else " (recipe differs)"
        lines.append(f"| {r.framework} | {r.model} | {r.gpus} ({r.tp} x {r.dp_shard} x {r.dp_replicate}) | {r.micro} x "
                     f"{r.accumulation}, {r.seq} | {r.ac}, {'compiled' if r.compile else 'eager'} | "
                     f"{r.measured_tokens_per_gpu_s:,.0f} / {p['tokens_per_gpu_s']:,.0f} ({p['speed_error']:+.0%}) | "
                     f"{mem} / {p['memory_gib']:.1f}{err} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
