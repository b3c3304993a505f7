"""The spike drill of docs/training.md: the default run on a copy of its data whose batches 110 and 150 hold random
tokens, once with train.spike=warn (the spikes are trained on) and once with train.spike=rewind (checkpoints every
20 steps), plotted together by launch/plot_metrics.py.

    python benchmarks/spike_drill.py --out /tmp/drill     # ~3 minutes on a 2-core CPU

Writes <out>/warn and <out>/rewind (run dirs), <out>/spike_drill.png and prints each run's spike and rewind rows
and final validation loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # spike_data.py: the poisoned copy of the data

POISONED = [110, 150]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/hybridpar"))
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    from hybridpar.config import DataConfig
    from hybridpar.config.cli import load_config
    from hybridpar.data.dataset import load_data_tokenizer, prepare_builtin
    from spike_data import poison_batches

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = DataConfig(cache_dir=args.cache_dir)
    tokenizer = load_data_tokenizer(d)
    prefix, _ = prepare_builtin(d, tokenizer)
    tokenizer.save(out)
    modes = {"warn": ["--train.spike", "warn"],
             "rewind": ["--train.spike", "rewind", "--checkpoint.interval", "20"]}
    rows = {}
    for mode, flags in modes.items():
        # Each mode's own copy: rewinds build the split for more batches, so its sample order is its own.
        common = ["--train.steps", str(args.steps), "--data.cache_dir", args.cache_dir, "--data.tokenizer",
                  f"bpe:{out / 'tokenizer.json'}", "--logging.interval", "5", "--logging.wandb.mode", "disabled",
                  *flags]
        cfg = load_config([*common, "--data.path", prefix, "--model.vocab_size", str(tokenizer.vocab_size)])
        data = out / f"data-{mode}"
        poison_batches(cfg, POISONED, str(data))
        run_dir = out / mode
        r = subprocess.run([sys.executable, "launch/pretrain_gpt.py", *common, "--data.path", str(data),
                            "--run.dir", str(run_dir), "--run.overwrite", "true"], cwd=ROOT, text=True,
                           capture_output=True)
        if r.returncode:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        rows[mode] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        events = [r for r in rows[mode] if "spike" in r or "rewind" in r]
        val = [r["val_loss"] for r in rows[mode] if "val_loss" in r]
        print(f"{mode}: final val_loss {val[-1]:.4f}")
        for e in events:
            print("   ", json.dumps(e))
    subprocess.run([sys.executable, "launch/plot_metrics.py", str(out / "warn"), str(out / "rewind"), "--out",
                    str(out / "spike_drill.png")], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
