"""What parallel.exact_reduction costs and changes, on the default run.

  python benchmarks/exact_reduction.py curves [--steps 100] [--nproc 4] [--work DIR]

Trains the default run's model, data and optimizer for --steps steps on --nproc gloo ranks (dp_shard = nproc, one
intra-op thread a rank, as torchrun sets), once with the mode off and once on, and prints:
- the loss curves' largest relative difference (and the gradient norms'), step by step;
- the median step time of each (steps 6 onwards; logged every step);
- the bytes the collectives of step --profile-step moved on rank 0, from its profiler trace (an all-gather's output,
  a reduce-scatter's input, an all-reduce's tensor, each at its dtype's size), beside the planner's FSDP figures
  (hybridpar.planning.cost.step_time: fsdp_gather_bytes, fsdp_scatter_bytes) for the same config.
With --control it also trains the mode off on nproc / 2 ranks: how far the default's own curve moves when only its
sum order changes (another dp degree), the scale against which the first difference is read.

  python benchmarks/exact_reduction.py error

The first step of the default run's model and data (fp32, 32 microbatches of one sequence) in one process: every
microbatch's gradient, summed four ways: in float64 (the reference, rounded once to float32), in float32 in one
rank's order (as .grad accumulates), in float32 as 4 ranks would (each its 8, then the 4 partial sums), and as the
mode does (int64 on the grid of this step's largest term, then rounded once to float32). Prints each float32 sum's
largest error relative to the parameter's largest microbatch term and in float32 spacings (ulps) at the true sum,
and the share of elements equal to the correctly rounded reference.
Figures and their dates are in docs/performance.md ("Exact reduction").
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"float": 4, "double": 8, "long int": 8, "int": 4, "c10::BFloat16": 2, "bool": 1}
COLLECTIVES = {"c10d::_allgather_base_": 0, "c10d::_reduce_scatter_base_": 1, "c10d::allreduce_": 0}


def run(work: Path, exact: bool, args) -> Path:
    run_dir = work / ("exact" if exact else "default")
    argv = ["--train.steps", str(args.steps), "--logging.interval", "1", "--train.eval_interval", "0",
            "--train.eval_tasks_interval", "0", "--train.sample_tokens", "0", "--logging.wandb.mode", "disabled",
            "--parallel.dp_shard", str(args.nproc), "--parallel.exact_reduction", str(exact).lower(),
            "--profile.steps", f"{args.profile_step}-{args.profile_step}", "--run.dir", str(run_dir),
            "--data.cache_dir", str(work / "cache")]
    if (run_dir / "metrics.jsonl").exists() and max(rows(run_dir), default=0) == args.steps:
        return run_dir  # (--work of an earlier call: its complete run is reused)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "launch/pretrain_gpt.py", *argv]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return run_dir


def rows(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "loss" in r}


def moved(run_dir: Path) -> dict[str, int]:
    """Bytes per collective kind in rank 0's trace of the profiled step."""
    trace = json.loads(sorted((run_dir / "profile").glob("rank0*.json"))[0].read_text())
    out = collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("name") in COLLECTIVES:
            i = COLLECTIVES[e["name"]]
            dims, types = e["args"]["Input Dims"], e["args"]["Input type"]
            name = e["name"].split("::")[1].strip("_")
            if types[i] == "TensorList":  # (an all-reduce: its tensors' dtype is not in the trace; elements)
                out[f"{name} elements"] += sum(math.prod(d) for d in dims[i])
                out[f"{name} calls"] += 1
            else:
                out[f"{name} bytes"] += SIZES[types[i]] * math.prod(dims[i])
    return dict(out)


def compare(name: str, a: dict[int, dict], b: dict[int, dict]) -> None:
    steps = sorted(a)
    print(f"  {name}:")
    for k in ("loss", "grad_norm"):
        r = [abs(a[s][k] - b[s][k]) / abs(b[s][k]) for s in steps]
        worst = max(range(len(r)), key=r.__getitem__)
        first = next((s for s, x in zip(steps, r) if x > 1e-6), None)
        print(f"    {k}: largest relative difference {r[worst]:.3g} (step {steps[worst]}), last step {r[-1]:.3g}, "
              f"steps 1-10 at most {max(r[:10]):.3g}, first step past 1e-6: {first}; bitwise equal steps: "
              f"{sum(x == 0 for x in r)}")


def curves(args) -> int:
    work = args.work or Path(tempfile.mkdtemp(prefix="hybridpar-exact-"))
    dirs = {exact: run(work, exact, args) for exact in (False, True)}
    curves = {exact: rows(d) for exact, d in dirs.items()}
    print(f"{len(curves[False])} steps on {args.nproc} gloo ranks (dp_shard {args.nproc}), work dir {work}")
    compare("mode on against mode off", curves[True], curves[False])
    if args.control:
        half = argparse.Namespace(**{**vars(args), "nproc": args.nproc // 2})
        other = rows(run(work / "control", False, half))
        compare(f"mode off on {half.nproc} ranks against mode off on {args.nproc}", other, curves[False])
    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import Layout
    from hybridpar.planning.cost import GPUS, plan_of, step_time

    for exact, d in dirs.items():
        times = [r["step_time"] for s, r in sorted(curves[exact].items()) if s > 5]
        cfg = load_config(["--parallel.dp_shard", str(args.nproc), "--parallel.exact_reduction", str(exact).lower(),
                           "--train.precision", "fp32"])
        plan = step_time(plan_of(cfg, Layout(1, args.nproc, 1)), GPUS["h100"], 8)
        print(f"  mode {'on ' if exact else 'off'}: median step time {statistics.median(times) * 1e3:.1f} ms; "
              f"step {args.profile_step} moved (rank 0) {moved(d)}; planner: all-gather "
              f"{plan['fsdp_gather_bytes']}, reduce-scatter {plan['fsdp_scatter_bytes']}")
    return 0


def error(_args) -> int:
    import torch

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import shutdown
    from hybridpar.parallel.exact import _quantize, quantum_of
    from hybridpar.session import start_trainer

    cache = Path(tempfile.mkdtemp(prefix="hybridpar-exact-"))
    cfg = load_config(["--train.precision", "fp32", "--train.micro_batch_size", "1", "--train.eval_interval", "0",
                       "--train.sample_tokens", "0", "--logging.wandb.mode", "disabled", "--data.cache_dir",
                       str(cache)])
    trainer = start_trainer(cfg)
    model, microbatches = trainer.model, trainer.data.train.microbatches(0)
    tokens = sum(int((y != -100).sum()) for _, y in microbatches)
    terms: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for x, y in microbatches:
        model.zero_grad(set_to_none=True)
        (trainer.numerics.forward_loss(model, x, y) / tokens).backward()
        for n, p in model.named_parameters():
            terms[n].append(p.grad.detach().clone())
    ways = {"float32, one rank's order": [], "float32, 4 ranks' order": [], "the mode (int64)": []}
    for n, gs in terms.items():
        g = torch.stack(gs)  # [microbatches, ...]
        ref = g.double().sum(0)
        largest = float(g.abs().max())
        one = g[0].clone()
        for t in g[1:]:
            one += t
        parts = [sum(g[r * 8 + 1:(r + 1) * 8], g[r * 8].clone()) for r in range(4)]
        four = sum(parts[1:], parts[0].clone())
        q = quantum_of(largest)
        mode = (sum(_quantize(t, q) for t in g).double() * q).float()
        rounded = ref.float().abs()
        ulp = (rounded.nextafter(torch.tensor(math.inf)) - rounded).double()  # float32 spacing at the true sum
        for way, v in zip(ways, (one, four, mode)):
            ways[way].append((float((v.double() - ref).abs().max()) / largest if largest else 0.0,
                              int((v == ref.float()).sum()), v.numel(), float(((v.double() - ref).abs() / ulp).max())))
    print(f"step 1 of the default run's model, {len(microbatches)} microbatches of one sequence, "
          f"{sum(t[0].numel() for t in terms.values()):,} gradient elements; error relative to each parameter's "
          f"largest microbatch term, and elements equal to the float64 sum rounded once to float32:")
    for way, rows_ in ways.items():
        worst = max(r[0] for r in rows_)
        equal = sum(r[1] for r in rows_) / sum(r[2] for r in rows_)
        ulps = max(r[3] for r in rows_)
        print(f"  {way:28s} largest error {worst:.3g} (2^{math.log2(worst) if worst else float('-inf'):.1f}), "
              f"{ulps:.2f} float32 ulps of the sum; correctly rounded: {100 * equal:.4f}%")
    trainer.data.close()
    shutdown()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("curves")
    c.add_argument("--steps", type=int, default=100)
    c.add_argument("--nproc", type=int, default=4)
    c.add_argument("--profile-step", type=int, default=50)
    c.add_argument("--control", action="store_true", help="also the mode off on nproc / 2 ranks")
    c.add_argument("--work", type=Path, default=None, help="keep the runs here (default: a temporary dir)")
    sub.add_parser("error")
    args = ap.parse_args()
    return curves(args) if args.what == "curves" else error(args)


if __name__ == "__main__":
    sys.exit(main())
