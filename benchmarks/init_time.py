"""Start-up cost of one rank: the trainer's own start-up (meta build, parallelize, materialise and initialise this
rank's shards) under a fake process group of the given world size, against initialising the whole model on one
device with torch's own normal_ (what every rank did before sharded init).

    python benchmarks/init_time.py --model gpt3-1.3b --world 1 4
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridpar.config.cli import load_config
from hybridpar.planning.dry_run import dry_run


def whole_model_seconds(name: str) -> float:
    """Every parameter of the unsharded model drawn with torch's normal_, in one process (the old start-up)."""
    from hybridpar.models import build_model, get_model_config

    model = build_model(get_model_config(name), device="meta", init=False)
    start = time.perf_counter()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["gpt2-774m", "gpt3-1.3b"])
    p.add_argument("--world", nargs="+", type=int, default=[1, 4])
    a = p.parse_args()
    print(f"{'model':<12} {'world':>5} {'layout':>9} {'shard GiB':>9} {'init s':>7}   whole-model normal_ s")
    for name in a.model:
        whole = whole_model_seconds(name)
        for world in a.world:
            cfg = load_config(["--model.name", name, "--train.precision", "fp32", "--train.global_batch_size",
                               str(world), "--parallel.dp_shard", str(world)])
            d = dry_run(cfg, world, rank=0)
            print(f"{name:<12} {world:>5} {'1x%dx1' % world:>9} {d['dry_run_materialized_bytes'] / 2**30:>9.2f} "
                  f"{d['dry_run_init_seconds']:>7.2f}   {whole:.2f}")


if __name__ == "__main__":
    main()
