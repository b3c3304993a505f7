"""The fp8 convergence gate: does fp8 train this model as well as its own precision does? Run it on a new model (or
a new recipe) before a long fp8 run.

From one seed checkpoint (the same initial weights and data order), N steps in the run's precision and N steps with
each fp8 recipe; the gap is the fp8 run's mean training loss over the last tenth of the steps minus the baseline's,
relative to the baseline's. The gate passes when every recipe's gap is within --threshold. Every run is the real
launcher in its own process (torchrun with --nproc > 1); the pretrain arguments after `--` go to each run.

    python benchmarks/fp8_gate.py --steps 300 --out /tmp/gate -- --config configs/gpt3-1.3b.yaml
    python benchmarks/fp8_gate.py --steps 50 --out /tmp/gate -- --train.precision fp32   # CPU, emulated fp8

Writes <out>/fp8_gate.json ({"steps", "threshold", "baseline", "final": {run: loss}, "gap": {recipe: relative gap},
"passed"}) and one line per recipe; exits 1 when the gate fails.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.eval_tasks", "",
         "--logging.interval", "1", "--logging.wandb.mode", "disabled"]


def launch(args: list[str], nproc: int) -> None:
    runner = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    done = subprocess.run([sys.executable, *runner, str(ROOT / "launch" / "pretrain_gpt.py"), *args], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"fp8_gate: a run failed ({' '.join(args[-4:])}):\n{done.stderr.strip()[-3000:]}")


def tail_loss(run_dir: Path, steps: int) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    return statistics.fmean(losses[s] for s in range(steps - max(1, steps // 10) + 1, steps + 1))


def main(argv: list[str]) -> int:
    own, pretrain = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="training steps of each run")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="largest relative gap of the final loss that passes (default 1%%)")
    p.add_argument("--recipes", default="tensorwise,rowwise", help="fp8 recipes to gate, comma-separated")
    p.add_argument("--nproc", type=int, default=1, help="processes per run (torchrun)")
    p.add_argument("--out", type=Path, required=True, help="directory for the runs and fp8_gate.json")
    a = p.parse_args(own)
    a.out.mkdir(parents=True, exist_ok=True)
    seed = a.out / "seed"
    launch([*pretrain, *QUIET, "--train.steps", "0", "--checkpoint.interval", "1", "--run.dir", str(seed)], a.nproc)
    start = seed / "checkpoints" / "step_00000000"
    runs = {"baseline": [], **{r: ["--train.fp8", r] for r in a.recipes.split(",")}}
    final = {}
    for name, extra in runs.items():
        run_dir = a.out / name
        launch([*pretrain, *QUIET, *extra, "--train.steps", str(a.steps), "--checkpoint.load", str(start),
                "--checkpoint.interval", "0", "--run.dir", str(run_dir)], a.nproc)
        final[name] = tail_loss(run_dir, a.steps)
    gap = {r: (final[r] - final["baseline"]) / final["baseline"] for r in runs if r != "baseline"}
    passed = all(abs(g) <= a.threshold for g in gap.values())
    report = {"steps": a.steps, "threshold": a.threshold, "baseline": final["baseline"], "final": final, "gap": gap,
              "passed": passed}
    (a.out / "fp8_gate.json").write_text(json.dumps(report, indent=1) + "\n")
    for r, g in gap.items():
        print(f"fp8 {r}: final loss {final[r]:.4f} vs {final['baseline']:.4f} ({g:+.2%}) -> "
              f"{'pass' if abs(g) <= a.threshold else 'FAIL'} (threshold {a.threshold:.2%})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
