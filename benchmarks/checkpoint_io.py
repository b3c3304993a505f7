"""Checkpoint save/load speed: sync save, async save (how long the step loop is blocked, and the total), load.

    python benchmarks/checkpoint_io.py [--model gpt2-124m] [--dir /tmp/hybridpar-ckpt-bench]

One process, CPU, fp32 model + AdamW state (about 12 bytes per parameter on disk), written with DCP the way the
trainer writes it. The directory is removed at the end.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from hybridpar.models import build_model, get_model_config


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="hybridpar-ckpt-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(get_model_config(a.model), device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, 1000, (1, 32))
        model(x).float().mean().backward()
        opt.step()
        state = dict(zip(("model", "optim"), get_state_dict(model, opt)))

        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(root / "sync"))
        sync_s = time.perf_counter() - t0
        mb = _size(root / "sync") / 1e6

        group = dist.new_group(backend="gloo")
        t0 = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=str(root / "async"), process_group=group)
        blocked_s = time.perf_counter() - t0
        future.result()
        async_total_s = time.perf_counter() - t0

        fresh = dict(zip(("model", "optim"), get_state_dict(model, opt)))
        t0 = time.perf_counter()
        dcp.load(fresh, checkpoint_id=str(root / "sync"))
        load_s = time.perf_counter() - t0
        print(f"{a.model}: checkpoint {mb:,.0f} MB (model + AdamW state, fp32)")
        print(f"sync save  {sync_s:6.2f} s  {mb / sync_s:7.0f} MB/s")
        print(f"async save {blocked_s:6.2f} s blocking the step loop, {async_total_s:.2f} s until written "
              f"({mb / async_total_s:.0f} MB/s)")
        print(f"load       {load_s:6.2f} s  {mb / load_s:7.0f} MB/s")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
