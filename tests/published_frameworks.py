"""Published training runs of five frameworks, transcribed as each framework's repository states them, and the fit of
the planner's time model to them (hybridpar/planning/cost.py keeps the fitted constants; tests/test_plan.py holds them
equal to fit()). `python tests/published_frameworks.py` prints, per run, the measured step beside the planned one,
in sample (the constants fitted to every framework) and out of sample (fitted to the other frameworks alone).

Sources (each row's `source`):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md: Llama-3 8B (32 x 4096, 32 heads, 8 KV, FFN 14,336,
  vocab 128,256), seq 8192, H100 96 GB HBM2e at a 500 W cap (cost.GPUS["h100-96gb-500w"]), selective AC, bf16 FSDP
  (fp32 master weights). Its selective AC is per-op: it saves every second matmul's output and recomputes the others
  (torchtitan's _apply_ac_to_transformer_block, mm_count % 2), planned as Plan.recomputed_matmuls = 0.5.
- KempnerForge's H200 sweep (tests/published_runs.py) and the GPT-3 1.3B reference step there (hybridpar's own).
- torchao, docs/source/workflows/training.md: the same 8B on 8 H100, FSDP 8, micro 1, seq 8192, compile, per-op
  selective AC (torchtitan's, as above), bf16.
- llm-foundry, scripts/train/benchmarking/README.md: MPT models (GPT-shaped: multi-head attention, GELU 4x MLP,
  vocab 50,368), seq 2048, 80 GB H100, FSDP FULL_SHARD with bf16 parameters.
- KempnerForge, benchmarks/weak_scaling_160gpu/README.md (2026-06-30): H200, 4 a node, seq 4096, full AC, compile,
  its bf16 recipe (weights, gradients and moments in bf16: tests/published_runs.py's docstring), TP 4 x FSDP 2 to 40;
  every row of its Results table. It notes that its 70B at 8 GPUs "is memory-bound at 128.5 GB of 141".
- nanotron: Llama-1B on 8 H100, seq 4096, data parallelism without FSDP x TP. The shape is not in the row as given
  to us; Llama-3.2-1B's (16 x 2048, 32 heads, 8 KV, FFN 8192, vocab 128,256, tied) is assumed.

Each row's numerics are its `recipe`: "hybridpar" rows run hybridpar's default (fp32 master weights, bf16 compute);
"bf16" rows hold weights, gradients and moments in bf16 (8 bytes a parameter), planned with hybridpar's
optim.master_dtype=bf16 and optim.state_dtype=bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

import published_runs as pr
from hybridpar.config.cli import load_config
from hybridpar.parallel.distributed import Layout
from hybridpar.planning import cost
from hybridpar.planning.cost import GIB, GPUS, Plan, memory, plan_of, step_time, token_curve

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
    gpu: str  # a hybridpar.planning.cost.GPUS key
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
    cp: int = 1
    fp8: str = "off"  # train.fp8
    fused_loss: bool = True  # False: cross entropy over the whole logits (train.loss_chunk_tokens 0)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp_shard * self.dp_replicate * self.cp

    @property
    def measured_tokens_per_gpu_s(self) -> float:
        if self.tokens_per_gpu_s is not None:
            return self.tokens_per_gpu_s
        return self.micro * self.accumulation * self.dp_shard * self.dp_replicate * self.seq / self.step_s / self.gpus


TT, TAO = "torchtitan", "torchao"
TT_GPU = "h100-96gb-500w"
TT_SRC, TAO_SRC = "benchmarks/llama3_h100_202412_torchtitan.md", "docs/source/workflows/training.md"
LF, LF_SRC = "llm-foundry", "scripts/train/benchmarking/README.md"
KF, KF_SRC = "KempnerForge", "benchmarks/weak_scaling_160gpu/README.md"
NT, NT_SRC = "nanotron", "Llama-1B on 8 H100 (as given in hybridpar's issue 58)"
ROWS = [
    Published(TT, TT_SRC, "llama3-8b", TT_GPU, 1, 8, 1, 2, 1, 8192, "selective", False, "hybridpar", 5762, None, 82.4),
    Published(TT, TT_SRC, "llama3-8b", TT_GPU, 1, 8, 1, 2, 1, 8192, "selective", True, "hybridpar", 6667, None, 77.0),
    Published(TT, TT_SRC, "llama3-8b", TT_GPU, 1, 128, 1, 2, 1, 8192, "selective", False, "hybridpar", 5605, None,
              67.0),
    Published(TT, TT_SRC, "llama3-8b", TT_GPU, 1, 128, 1, 2, 1, 8192, "selective", True, "hybridpar", 6514, None, 62.0),
    Published(TAO, TAO_SRC, "llama3-8b", "h100", 1, 8, 1, 1, 1, 8192, "selective", True, "hybridpar", 6150, None,
              47.65, "GB"),
    Published(LF, LF_SRC, "mpt-1b", "h100", 1, 8, 1, 14, 1, 2048, "none", False, "bf16", 45455, None, None),
    Published(LF, LF_SRC, "mpt-7b", "h100", 1, 8, 1, 6, 1, 2048, "none", False, "bf16", 10643, None, None),
    Published(LF, LF_SRC, "mpt-13b", "h100", 1, 8, 1, 2, 1, 2048, "none", False, "bf16", 4792, None, None),
    Published(LF, LF_SRC, "mpt-70b", "h100", 1, 128, 1, 8, 1, 2048, "full", False, "bf16", 1058, None, None),
    # (micro x accumulation: the README's Models table, 4 x 4 for 13B and 2 x 4 for 70B; "GB" there is torch's
    # max_memory_allocated / 1024**3: GiB, as tests/published_runs.py's docstring reads it)
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 2, 1, 4, 4, 4096, "full", True, "bf16", None, 4.39, 45.0),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 8, 1, 4, 4, 4096, "full", True, "bf16", None, 4.75, 36.2),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 16, 1, 4, 4, 4096, "full", True, "bf16", None, 4.84, 34.8),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 32, 1, 4, 4, 4096, "full", True, "bf16", None, 4.95, 34.0),
    Published(KF, KF_SRC, "kf-13b", "h200", 4, 40, 1, 4, 4, 4096, "full", True, "bf16", None, 4.91, 33.9),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 2, 1, 2, 4, 4096, "full", True, "bf16", None, 18.09, 128.5),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 8, 1, 2, 4, 4096, "full", True, "bf16", None, 14.03, 93.2),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 16, 1, 2, 4, 4096, "full", True, "bf16", None, 14.63, 86.8),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 24, 1, 2, 4, 4096, "full", True, "bf16", None, 15.07, 84.6),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 32, 1, 2, 4, 4096, "full", True, "bf16", None, 14.98, 83.6),
    Published(KF, KF_SRC, "kf-70b", "h200", 4, 40, 1, 2, 4, 4096, "full", True, "bf16", None, 15.32, 82.9),
    Published(NT, NT_SRC, "llama3.2-1b", "h100", 4, 1, 2, 8, None, 4096, "none", False, "hybridpar", None, 18.9,
              25808, "MiB"),
    Published(NT, NT_SRC, "llama3.2-1b", "h100", 2, 1, 4, 8, None, 4096, "none", False, "hybridpar", None, 15.8,
              43651, "MiB"),
]

# torchtitan's context-parallel rows (the same file, 8 H100 96 GB): Llama-3 8B, micro 1, full AC, compile, float8
# (tensorwise, its default), FSDP x CP over the 8 GPUs at 32k to 256k tokens a sequence. Not fitted: the planner's
# check on long sequences (tests/test_plan.py).
CP_ROWS = [
    Published(TT, TT_SRC, "llama3-8b", TT_GPU, 1, 8 // cp, 1, 1, 1, 32768 * cp, "full", True, "hybridpar", tok, None,
              mem, cp=cp, fp8="tensorwise", fused_loss=False)
    for cp, tok, mem in ((1, 3890, 83.9), (2, 2540, 84.2), (4, 1071, 84.0), (8, 548, 84.5))]


def config(row: Published):
    """hybridpar's config of a row: its model, batch, sequence, checkpointing and compile, in bf16."""
    dp = row.dp_shard * row.dp_replicate
    return load_config([
        *SHAPES[row.model], "--model.max_seq_len", str(row.seq), "--train.seq_len", str(row.seq),
        "--train.precision", "bf16", "--train.micro_batch_size", str(row.micro),
        "--train.global_batch_size", str(row.micro * row.accumulation * dp),
        "--train.activation_checkpointing", row.ac, "--train.compile", str(row.compile).lower(),
        "--parallel.tp", str(row.tp), "--parallel.dp_shard", str(row.dp_shard),
        "--parallel.dp_replicate", str(row.dp_replicate), "--parallel.sequence_parallel", str(row.tp > 1).lower(),
        "--parallel.cp", str(row.cp), "--train.fp8", row.fp8, *([] if row.fused_loss else ["--train.loss_chunk_tokens", "0"]),
        *(pr.LEAN if row.recipe == "bf16" else [])])


# Per framework, what its recipe runs that hybridpar's own does not, as the plan's settings: the share of the blocks'
# forward matmuls its selective checkpointing recomputes (Plan.recomputed_matmuls), and whether its FSDP schedule is
# KempnerForge's (every microbatch gathers twice, one reduce-scatter a step: tests/published_runs.py).
RECOMPUTED_MATMULS = {TT: 0.5, TAO: 0.5}
NO_SYNC_ACCUMULATION = {KF}


@dataclass(frozen=True)
class Measurement:
    """One published step, as the time model sees it: the plan it ran, where, and the measured seconds."""
    framework: str
    label: str
    plan: Plan
    gpu: str
    gpus_per_node: int
    step_s: float
    fsdp_s: float | None = None  # the recipe's FSDP link seconds where its schedule is not hybridpar's

    def terms(self) -> dict:
        """The step's terms (hybridpar.planning.cost.step_time) and, for the fit, the fitted constants' features:
        the matmuls' seconds at the peak over the token curve, FSDP's link seconds, one eager HBM pass, and the rest
        (attention, TP collectives, optimizer, selective recomputation, per-microbatch overhead)."""
        s = step_time(self.plan, GPUS[self.gpu], self.gpus_per_node)
        fsdp = s["fsdp_comm_s"] if self.fsdp_s is None else self.fsdp_s
        attention = s["attention_at_peak_s"] / cost.ATTENTION_EFFICIENCY
        rest = s["step_time_s"] - s["compute_s"] - s["eager_s"] - s["fsdp_exposed_s"]
        return {"step": s, "gemm": s["gemm_at_peak_s"] / token_curve(self.plan.tokens), "fsdp": fsdp,
                "eager": s["eager_traffic_s"], "attention": attention, "rest": rest,
                "width": self.plan.m.d_model / self.plan.layout.tp}

    def planned(self) -> float:
        """The planned step: cost.step_time with the recipe's FSDP schedule."""
        t = self.terms()
        s = t["step"]
        if self.fsdp_s is None:
            return s["step_time_s"]
        return s["step_time_s"] - s["fsdp_exposed_s"] + cost.exposed_fsdp(self.fsdp_s, s["compute_s"])


def _kf_sweep() -> list[Measurement]:
    out = []
    for r in pr.ROWS:
        cfg = pr.config(r)
        out.append(Measurement(KF, f"mfu sweep row {r.n}: {r.model} tp {r.tp} x fsdp {r.dp_shard}, {r.micro} x "
                               f"{r.accumulation}", plan_of(cfg, Layout(1, r.dp_shard, r.tp)), "h200",
                               pr.GPUS_PER_NODE, r.step_s, pr.published_fsdp_seconds(cfg, r)))
    cfg = load_config(pr.REFERENCE_1_3B[0])
    out.append(Measurement("hybridpar", "gpt3-1.3b one H200, 8 x 2048", plan_of(cfg, Layout(1, 1, 1)), "h200", 4,
                           pr.REFERENCE_1_3B[1]))
    return out


def measurement(row: Published) -> Measurement:
    """A row of ROWS as the time model sees it."""
    cfg, layout = config(row), Layout(row.dp_replicate, row.dp_shard, row.tp, row.cp)
    plan = replace(plan_of(cfg, layout), recomputed_matmuls=RECOMPUTED_MATMULS.get(row.framework, 0.0))
    per_node = 4 if row.gpu == "h200" else 8  # (KempnerForge's nodes hold 4 H200; the others' 8)
    fsdp = (pr.recipe_fsdp_seconds(cfg, layout, row.accumulation, row.gpu, per_node)
            if row.framework in NO_SYNC_ACCUMULATION else None)
    step = row.micro * row.accumulation * row.dp_shard * row.dp_replicate * row.seq / (
        row.measured_tokens_per_gpu_s * row.gpus)
    label = (f"{row.model} {row.gpus} GPUs (tp {row.tp} x fsdp {row.dp_shard}{f' x cp {row.cp}' if row.cp > 1 else ''}), "
             f"{row.micro} x {row.accumulation} x "
             f"{row.seq}, AC {row.ac}, {'compiled' if row.compile else 'eager'}")
    return Measurement(row.framework, label, plan, row.gpu, per_node, step, fsdp)


def measurements() -> list[Measurement]:
    """Every published step the time model is fitted to and checked on (the nanotron rows give no accumulation)."""
    return _kf_sweep() + [measurement(r) for r in ROWS if r.accumulation is not None]


# cuBLASLt square GEMMs (m = n = k) on an H100 SXM, TFLOPS (samuel-bohman/AI-benchmarking-guide,
# Azure_Results/ND_H100_v5_results.md; float8 inputs, the only dtype it sweeps): the widths training GEMMs have, and
# the plateau (32,768) they approach
GEMM_SWEEP = {2048: 1011.3, 4096: 1216.9, 8192: 1290.1}
GEMM_PLATEAU = 1382.2


def half_width() -> int:
    """GEMM_HALF_WIDTH: the h of width / (width + h) closest (least squares) to GEMM_SWEEP's rates over the
    plateau's, on a grid of whole numbers."""
    w = np.array(list(GEMM_SWEEP), dtype=float)
    r = np.array(list(GEMM_SWEEP.values())) / GEMM_PLATEAU
    return min(range(0, 4097), key=lambda h: float(np.sum(np.square(w / (w + h) - r))))


def _features(ms: list[Measurement]) -> dict[str, np.ndarray]:
    ts = [m.terms() for m in ms]
    out = {k: np.array([t[k] for t in ts], dtype=float) for k in ("gemm", "fsdp", "eager", "attention", "rest",
                                                                    "width")}
    out["gemm"] *= (out["width"] + cost.GEMM_HALF_WIDTH) / out["width"]  # the matmuls' seconds at GEMM_EFFICIENCY 1
    out["y"] = np.array([m.step_s for m in ms])
    return out


def _predict(f: dict, coef: np.ndarray) -> np.ndarray:
    """Planned steps with the constants (1 / GEMM_EFFICIENCY, EAGER_HBM_PASSES), composed as cost.step_time does
    (exposed FSDP: cost.exposed_fsdp of the link seconds and this compute)."""
    compute = coef[0] * f["gemm"] + f["attention"]
    return compute + f["fsdp"] ** 2 / (f["fsdp"] + compute) + coef[1] * f["eager"] + f["rest"]


def _solve(f: dict, keep: np.ndarray) -> np.ndarray:
    """(1 / GEMM_EFFICIENCY, EAGER_HBM_PASSES) over the measurements in keep: least squares on relative errors of
    the step, linear in the two once the exposed FSDP seconds are fixed, which depend on compute and so on the first:
    alternated until it settles (to 1e-12; a few dozen rounds)."""
    y, coef = f["y"], np.array([1.0, 0.0])
    for _ in range(200):
        compute = coef[0] * f["gemm"] + f["attention"]
        fixed = f["attention"] + f["rest"] + f["fsdp"] ** 2 / (f["fsdp"] + compute)
        x = np.stack([f["gemm"], f["eager"]], axis=1)
        new, *_ = np.linalg.lstsq(x[keep] / y[keep, None], (y[keep] - fixed[keep]) / y[keep], rcond=None)
        if np.abs(new - coef).max() < 1e-12:
            return new
        coef = new
    raise RuntimeError("the fit did not settle")


def fit() -> dict:
    """The time model's two fitted constants, GEMM_EFFICIENCY and EAGER_HBM_PASSES, from every measurement
    (_solve; GEMM_HALF_WIDTH and ATTENTION_EFFICIENCY are published figures, the FSDP exposure a form without a
    constant). Out of sample: each framework's steps planned with the two fitted to the other frameworks alone.
    Returns the constants and, per measurement, both errors."""
    ms = measurements()
    f, groups = _features(ms), np.array([m.framework for m in ms])
    coef = _solve(f, np.ones(len(ms), bool))
    out_of_sample = np.zeros(len(ms))
    for g in set(groups):
        held = groups == g
        out_of_sample[held] = (_predict(f, _solve(f, ~held)) / f["y"] - 1)[held]
    return {"GEMM_EFFICIENCY": 1 / coef[0], "EAGER_HBM_PASSES": coef[1], "measurements": ms,
            "in_sample": _predict(f, coef) / f["y"] - 1, "out_of_sample": out_of_sample}


def memory_row(row: Published) -> dict:
    """The planned memory of a row with a published figure: hybridpar's plan of the row's recipe (the bf16 one
    through optim.master_dtype and optim.state_dtype), and for KempnerForge's the parts its recipe holds that
    hybridpar's does not (tests/published_runs.py: published_memory)."""
    plan = measurement(row).plan
    if row.framework == KF:
        gib = sum(pr.published_memory(config(row), row).values()) / GIB
    else:
        gib = memory(plan)["total_bytes_per_gpu"] / GIB
    measured = row.memory * UNITS[row.unit]
    return {"memory_gib": gib, "measured_gib": measured, "memory_error": gib / measured - 1}


def table(f: dict | None = None) -> str:
    """docs/planning.md's table (tests/test_plan.py keeps it equal to this): per published step, measured and planned
    (the constants in cost.py, fitted to every framework), and planned from the other frameworks alone."""
    f = f or fit()
    lines = ["| framework | run | step: measured / planned | in sample | out of sample |",
             "| --- | --- | --- | --- | --- |"]
    for m, e_in, e_out in zip(f["measurements"], f["in_sample"], f["out_of_sample"]):
        lines.append(f"| {m.framework} | {m.label} | {m.step_s:.2f} s / {m.planned():.2f} s | {e_in:+.0%} | "
                     f"{e_out:+.0%} |")
    for r in ROWS:
        if r.accumulation is None:
            lines.append(f"| {r.framework} | {r.model} {r.gpus} GPUs (tp {r.tp} x dp {r.dp_replicate}), micro "
                         f"{r.micro} | not planned: the row gives no gradient accumulation | | |")
    return "\n".join(lines)


def memory_table() -> str:
    """docs/planning.md's memory table: every planned row with a published memory figure, planned with its recipe."""
    lines = ["| framework | run | recipe | memory GiB: measured / planned |", "| --- | --- | --- | --- |"]
    for r in ROWS:
        if r.accumulation is None or r.memory is None:
            continue
        p = memory_row(r)
        recipe = "fp32 masters" if r.recipe == "hybridpar" else "bf16 weights and moments"
        lines.append(f"| {r.framework} | {measurement(r).label} | {recipe} | {p['measured_gib']:.1f} / "
                     f"{p['memory_gib']:.1f} ({p['memory_error']:+.0%}) |")
    return "\n".join(lines)


def cp_table() -> str:
    """docs/planning.md's context-parallel table: torchtitan's CP rows (not fitted), measured and planned step and
    memory, and the attention's implied share of the bf16 peak (the measured step less every planned term but
    attention, over the attention FLOPs' seconds at the peak)."""
    lines = ["| run | step: measured / planned | memory GiB: measured / planned | attention at |",
             "| --- | --- | --- | --- |"]
    for r in CP_ROWS:
        m, mem = measurement(r), memory_row(r)
        s = m.terms()["step"]
        implied = s["attention_at_peak_s"] / (m.step_s - m.planned() + s["attention_at_peak_s"] / cost.ATTENTION_EFFICIENCY)
        lines.append(f"| {m.label}, fp8 | {m.step_s:.1f} s / {m.planned():.1f} s ({m.planned() / m.step_s - 1:+.0%}) | "
                     f"{mem['measured_gib']:.1f} / {mem['memory_gib']:.1f} ({mem['memory_error']:+.0%}) | "
                     f"{implied:.0%} of peak |")
    return "\n".join(lines)


if __name__ == "__main__":
    f = fit()
    print(table(f))
    print()
    print(memory_table())
    print()
    print(cp_table())
    rms = {k: float(np.sqrt(np.mean(np.square(f[k])))) for k in ("in_sample", "out_of_sample")}
    print(f"\nGEMM_HALF_WIDTH {half_width()} (GEMM_SWEEP); fit: " + ", ".join(
        f"{k} {f[k]:.3f}" for k in ("GEMM_EFFICIENCY", "EAGER_HBM_PASSES")))
    print(f"in sample: {f['in_sample'].min():+.0%} to {f['in_sample'].max():+.0%} (RMS {rms['in_sample']:.1%}); "
          f"out of sample: {f['out_of_sample'].min():+.0%} to {f['out_of_sample'].max():+.0%} (RMS "
          f"{rms['out_of_sample']:.1%})")
