"""Does Muon train better than AdamW here? A learning-rate sweep of each optimizer on the default data (the built-in
corpus, the 4096-token BPE), for the tiny preset and a wider CPU-sized one; then, at each optimizer's best lr,
the final validation loss at equal steps and the steps Muon needs to reach AdamW's best final validation loss;
and the step-time overhead of Muon on 1 and 4 ranks. Every run is the real launcher in its own process.

    python benchmarks/muon_vs_adamw.py --out /tmp/muon-bench          # about 17 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"tiny": [], "wide": ["--model.d_model", "192", "--model.n_heads", "6"]}  # 4 blocks of 128 / 192
COMMON = ["--train.global_batch_size", "16", "--train.seq_len", "128", "--train.precision", "fp32",
          "--train.sample_tokens", "0", "--logging.interval", "1", "--logging.wandb.mode", "disabled",
          "--optim.warmup_steps", "10"]


def run(out: Path, name: str, args: list[str], nproc: int = 1) -> list[dict]:
    run_dir = out / name
    if not (run_dir / "metrics.jsonl").exists():
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
        done = subprocess.run([sys.executable, *launcher, str(ROOT / "launch" / "pretrain_gpt.py"), *COMMON, *args,
                               "--run.dir", str(run_dir)], cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def val_curve(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


def step_seconds(rows: list[dict], skip: int = 5) -> float:
    """Median step time after the first `skip` steps (start-up, first-call costs)."""
    return statistics.median(r["step_time"] for r in rows if "step_time" in r and r["step"] > skip)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="runs and results.json go here (reused if present)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lrs", type=float, nargs=3, default=[1e-3, 3e-3, 1e-2])
    a = p.parse_args()
    results: dict = {"steps": a.steps, "lrs": a.lrs, "models": {}}
    for model, margs in MODELS.items():
        sweep = {}
        for optim in ("adamw", "muon"):
            for lr in a.lrs:
                rows = run(a.out, f"{model}-{optim}-{lr:g}", [*margs, "--optim.name", optim, "--optim.lr", str(lr),
                                                             "--optim.min_lr", str(lr / 10), "--train.steps",
                                                             str(a.steps), "--train.eval_interval", "20"])
                sweep[optim, lr] = (val_curve(rows), step_seconds(rows))
        best = {o: min(a.lrs, key=lambda lr: sweep[o, lr][0][a.steps]) for o in ("adamw", "muon")}
        target = sweep["adamw", best["adamw"]][0][a.steps]
        muon_curve = sweep["muon", best["muon"]][0]
        reach = min((s for s, v in muon_curve.items() if v <= target), default=None)
        results["models"][model] = {
            "final_val_loss": {f"{o}@{lr:g}": sweep[o, lr][0][a.steps] for o in ("adamw", "muon") for lr in a.lrs},
            "best_lr": best, "adamw_best_final": target, "muon_best_final": muon_curve[a.steps],
            "muon_steps_to_adamw_best": reach,
            "step_seconds_1_rank": {o: sweep[o, best[o]][1] for o in ("adamw", "muon")}}
    four = {}
    for optim in ("adamw", "muon"):  # 4 ranks, dp_shard 2 x tp 2: the all-to-alls and FSDP + TP collectives
        rows = run(a.out, f"wide-{optim}-4ranks", [*MODELS["wide"], "--optim.name", optim, "--train.steps", "25",
                                                     "--train.eval_interval", "0", "--parallel.dp_shard", "2",
                                                     "--parallel.tp", "2"], nproc=4)
        four[optim] = step_seconds(rows)
    results["step_seconds_4_ranks_wide"] = four
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
