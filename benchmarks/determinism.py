"""Run-to-run determinism of a training process on this machine, and what could move a step's loss.

  python benchmarks/determinism.py fresh --runs 40 --concurrent 3 [--hogs 2] [--env OMP_NUM_THREADS=8] [--case staged]
      Starts --runs fresh training processes, --concurrent at a time, optionally beside --hogs busy-looping processes
      and with extra environment variables, and compares every step's (loss, grad_norm, batch_crc32) bit for bit.
      --case kill-resume (default): the kill/resume test's command (tiny GPT, 8 steps of 8 x 64 tokens, fp32,
      checkpoints every 2 steps). --case staged: test_stages' staged run (two byte-token sources written here, four
      stages with a ramp and a 64-token stage, 12 steps of 8 sequences, evaluation at steps 6 and 12).
      Prints how many distinct curves it saw and where the first one differs; exit 1 if more than one.

  python benchmarks/determinism.py sensitivity
      Builds the same trainer in this process and measures how far the first step's loss moves, in units of the
      loss's float32 spacing (ulp), when one thing about that step changes: the order of its sequences, the split
      into microbatches, the thread count, the weights by one ulp or by relative noise, one target token. A step-1
      difference seen between two runs can then be matched to the kind of cause that can produce it.

Figures and their dates are in docs/performance.md ("Determinism").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--train.steps", "8", "--train.global_batch_size", "8", "--train.seq_len", "64", "--logging.interval", "1",
        "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.precision", "fp32",
        "--checkpoint.interval", "2", "--checkpoint.keep_last", "3", "--logging.wandb.mode", "disabled"]


def staged_args(work: Path) -> list[str]:
    """test_stages' staged config over two sources written into work (its _source_files, with the same seed)."""
    import numpy as np

    from hybridpar.data.indexed import IndexedWriter

    rng, (web, code) = np.random.default_rng(0), (str(work / "web"), str(work / "code"))
    for prefix, lo, hi in ((web, 1, 128), (code, 128, 256)):
        with IndexedWriter(prefix, np.uint16) as w:
            for _ in range(300):
                w.add_document(np.append(rng.integers(lo, hi, int(rng.integers(20, 200))), 0).astype(np.uint16))
    stages = [f"0: {web}", f"3 ramp 3: 0.5 {web} 0.5 {code}", f"61s: 0.25 {web} 0.75 {code}", f"10 seq 64: {code}"]
    return ["--train.steps", "12", "--train.global_batch_size", "8", "--train.seq_len", "32", "--logging.interval",
            "1", "--train.eval_interval", "6", "--train.eval_batches", "1", "--train.eval_tasks", "",
            "--train.sample_tokens", "0", "--train.precision", "fp32", "--checkpoint.interval", "2",
            "--checkpoint.keep_last", "10", "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes",
            "--data.stages", ",".join(stages)]


def fresh(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="hybridpar-determinism-"))
    env = dict(os.environ, **dict(kv.split("=", 1) for kv in args.env))
    config = staged_args(work) if args.case == "staged" else ARGS
    base = [sys.executable, "launch/pretrain_gpt.py", *config, "--data.cache_dir", str(work / "cache")]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    curves: dict[tuple, list[int]] = {}
    running: list[tuple[subprocess.Popen, Path, int]] = []
    started = 0
    t0 = time.time()
    try:
        subprocess.run([*base, "--run.dir", str(work / "warm")], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL)  # builds the data caches once, outside the measured runs
        while started < args.runs or running:
            while started < args.runs and len(running) < args.concurrent:
                run_dir = work / f"run{started}"
                proc = subprocess.Popen([*base, "--run.dir", str(run_dir)], cwd=ROOT, env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                running.append((proc, run_dir, started))
                started += 1
            for proc, run_dir, i in list(running):
                if proc.poll() is None:
                    continue
                running.remove((proc, run_dir, i))
                if proc.returncode:
                    print(f"run {i} failed (exit {proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
                    return 2
                proc.stderr.close()
                rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
                curve = tuple((r["step"], r["loss"].hex(), r["grad_norm"].hex(), r["batch_crc32"]) if "loss" in r
                              else (r["step"], "val_loss", r["val_loss"].hex()) for r in rows
                              if "loss" in r or "val_loss" in r)
                curves.setdefault(curve, []).append(i)
                shutil.rmtree(run_dir)
            time.sleep(0.05)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        for proc, _, _ in running:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.runs} fresh processes, {args.concurrent} at a time, {args.hogs} busy loop(s), env {args.env or '-'}: "
          f"case {args.case}: {len(curves)} distinct curve(s) of (loss, grad_norm, batch_crc32; val_loss) over every step, "
          f"{time.time() - t0:.0f}s")
    ranked = sorted(curves.items(), key=lambda kv: -len(kv[1]))
    for curve, runs in ranked[1:]:
        first, ref = next((a, b) for a, b in zip(curve, ranked[0][0]) if a != b)
        print(f"  runs {runs} differ first at step {first[0]}: {first} vs {ref}")
    return 0 if len(curves) == 1 else 1


def sensitivity(_args) -> int:
    sys.argv = [sys.argv[0]]
    import torch

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import shutdown
    from hybridpar.session import start_trainer

    cache = Path(tempfile.mkdtemp(prefix="hybridpar-determinism-"))
    cfg = load_config([*ARGS, "--data.cache_dir", str(cache)])
    trainer = start_trainer(cfg)
    (x, y), = trainer.data.train.microbatches(0)
    model = trainer.model

    def loss(xs=x, ys=y, parts=1):
        step = xs.shape[0] // parts
        return float(sum(trainer.numerics.forward_loss(model, xs[i:i + step], ys[i:i + step]) for i in range(0, len(xs), step))
                     / (ys != -100).sum())

    with torch.no_grad():
        base = loss()
        ulp = float(torch.tensor(base).nextafter(torch.tensor(float("inf")))) - base
        rows = []

        def row(what, value):
            rows.append((what, abs(value - base) / ulp, abs(value - base) / base))

        row("sequences in reverse order", loss(x.flip(0), y.flip(0)))
        row("2 microbatches of 4", loss(parts=2))
        row("8 microbatches of 1", loss(parts=8))
        threads = torch.get_num_threads()
        for t in sorted({1, 2 * threads} - {threads}):
            torch.set_num_threads(t)
            row(f"{t} intra-op thread(s) instead of {threads}", loss())
        torch.set_num_threads(threads)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        gen = torch.Generator().manual_seed(0)

        def perturb(fn):
            for k, v in model.state_dict().items():
                if v.is_floating_point():
                    v.copy_(fn(saved[k]))

        perturb(lambda w: torch.where(torch.rand(w.shape, generator=gen) < 0.1, w.nextafter(w + 1), w))
        row("weights: 10% of entries one ulp up", loss())
        for eps in (1e-5, 1e-4, 1e-3):
            perturb(lambda w: w * (1 + eps * torch.randn(w.shape, generator=gen)))
            row(f"weights x (1 + {eps:g} N(0, 1))", loss())
        perturb(lambda w: w)
        for b, t in ((0, 0), (3, 30), (7, 63)):
            y2 = y.clone()
            y2[b, t] = (y2[b, t] + 1) % cfg.model.vocab_size
            row(f"target token [{b}, {t}] replaced", loss(ys=y2))
    print(f"step-1 loss {base!r} (float32 ulp {ulp:.3g}); how far each change moves it:")
    print(f"{'change':44s} {'ulps':>10s} {'relative':>10s}")
    for what, ulps, rel in rows:
        print(f"{what:44s} {ulps:10.1f} {rel:10.2e}")
    trainer.data.close()
    shutdown()
    shutil.rmtree(cache, ignore_errors=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fresh", help="compare the curves of many fresh training processes")
    f.add_argument("--runs", type=int, default=20)
    f.add_argument("--concurrent", type=int, default=2)
    f.add_argument("--hogs", type=int, default=0, help="busy-looping processes beside the runs")
    f.add_argument("--env", nargs="*", default=[], help="extra environment, e.g. OMP_NUM_THREADS=8")
    f.add_argument("--case", choices=("kill-resume", "staged"), default="kill-resume")
    sub.add_parser("sensitivity", help="how far the first step's loss moves under small changes")
    args = p.parse_args()
    return {"fresh": fresh, "sensitivity": sensitivity}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
