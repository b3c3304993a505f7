"""Measure training speed: hybridpar's full step (mesh, parallelize, scheduler, optimizer) after warm-up, and
optionally the same model and batch through a plain single-device PyTorch loop in the same process.

    python launch/benchmark.py --model.name gpt3-1.3b --train.seq_len 2048 --train.global_batch_size 8 \\
        --train.compile true --warmup 5 --steps 20 --baseline plain --json bench.json
    torchrun --nproc_per_node 8 launch/benchmark.py --config configs/gpt3-6.7b.yaml --steps 10

Every other argument is a training config override. Reports the median step time (CUDA events on GPU), tokens/s,
TFLOP/s per device and MFU (docs/metrics.md), peak memory, and the split of a step into data, forward+backward and
optimizer. On a GPU, steps and the optimizer are timed with CUDA events, so the timing adds no host sync to the
step. Nothing is written but the --json file.
"""

from __future__ import annotations

import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Literal, Optional
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.config.cli import ConfigError, parse_command
from hybridpar.models.config import doc
from hybridpar.config import Config
from hybridpar.models import build_model
from hybridpar.parallel.distributed import shutdown, world_from_env
from hybridpar.session import start_trainer


class _Marks:
    """Time stamps inside steps without host syncs: CUDA events on a GPU (read once, after the timed loop), the
    host clock on a CPU (where work is synchronous anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1000.0
        return b - a


def bench_hybridpar(cfg, warmup: int, steps: int) -> tuple[dict, torch.device, Config]:
    """The measurement, the device and the resolved config it ran: the trainer's own loop (fit) for warmup + steps
    steps, without evaluations, sample or checkpoints, its log rows at the end only."""
    tmp = Path(tempfile.mkdtemp(prefix="hybridpar-bench-"))
    cfg = replace(cfg, train=replace(cfg.train, steps=warmup + steps, eval_interval=0, eval_tasks=[], sample_tokens=0),
                  checkpoint=replace(cfg.checkpoint, interval=0), run=replace(cfg.run, dir=str(tmp)),
                  logging=replace(cfg.logging, interval=warmup + steps))
    trainer = start_trainer(cfg)  # the trainer's own start-up path, on a run dir nothing is written into
    cfg, device = trainer.cfg, trainer.device
    trainer.open_log(enabled=False)
    marks = _Marks(device)
    opt_marks: list = []  # (pre, post) per optimizer step
    trainer.optimizer.register_step_pre_hook(lambda *_: opt_marks.append([marks.mark()]))
    trainer.optimizer.register_step_post_hook(lambda *_: opt_marks[-1].append(marks.mark()))
    step_marks, waited = [], []  # at each step's start and after the last; the data waits from the first timed

    def on_step(done: int) -> None:
        if done == warmup:
            opt_marks.clear()
            waited.append(trainer.clock.data_wait_total)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
        step_marks.append(marks.mark())

    trainer.fit(on_step=on_step)
    timed = [marks.seconds(a, b) for a, b in zip(step_marks[warmup:], step_marks[warmup + 1:])]
    data_s = trainer.clock.data_wait_total - waited[0]
    optimizer_s = sum(marks.seconds(a, b) for a, b in opt_marks)
    step_time = statistics.median(timed)
    t = cfg.train
    tps = t.global_batch_size * t.seq_len / step_time
    n = dist.get_world_size()
    tflops = trainer.rates.flops_per_token * tps / n / 1e12
    peak = trainer.rates.peak_tflops
    total = sum(timed)
    from hybridpar.planning.cost import memory, plan_of

    result = {
        # the run's resolved config: what it chose
        "planned_bytes": memory(plan_of(cfg, trainer.run.layout))["total_bytes_per_gpu"],
        "accumulate_unsharded": cfg.parallel.accumulate_unsharded,
        "microbatches": trainer.run.microbatches,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None,
        "tokens_per_sec": tps, "tokens_per_sec_per_device": tps / n, "step_time_s": step_time,
        "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "split": {"data_s": data_s / steps, "optimizer_s": optimizer_s / steps,
                  "forward_backward_s": (total - data_s - optimizer_s) / steps},
        "world_size": n, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    shutil.rmtree(tmp, ignore_errors=True)  # the run dir the trainer was given (nothing is written into it)
    return result, device, cfg


def free_device_memory(device: torch.device) -> None:
    """Give the cached blocks of a finished measurement back, so the next one starts from an empty device."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_plain(cfg, device: torch.device, warmup: int, steps: int) -> float:
    """Tokens/s of the same model and global batch in a plain loop: model, fused AdamW on CUDA, bf16 autocast on
    CUDA, optional torch.compile of the whole model; no mesh, no FSDP, no scheduler."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, device=device)
    if cfg.train.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=device.type == "cuda")
    t = cfg.train
    micro = t.micro_batch_size or t.global_batch_size
    x = torch.randint(0, min(cfg.model.vocab_size, 4096), (micro, t.seq_len + 1), device=device)
    use_bf16 = device.type == "cuda" and cfg.train.precision != "fp32"
    marks, step_marks = _Marks(device), []
    for s in range(warmup + steps):
        start = marks.mark()
        for _ in range(t.global_batch_size // micro):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                logits = model(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_marks.append((start, marks.mark()))
    times = [marks.seconds(a, b) for a, b in step_marks[warmup:]]
    return t.global_batch_size * t.seq_len / statistics.median(times)


@dataclass(frozen=True)
class Options:
    warmup: int = doc(3, "steps run before timing (allocation, kernel selection, compile)")
    steps: int = doc(10, "timed steps; the median step time is reported")
    json: Optional[str] = doc(None, "also write the result to this JSON file")
    baseline: Literal["none", "plain"] = doc("none", "plain: the same model and batch in a plain PyTorch loop")


def cli(argv: list[str]) -> int:
    try:
        parsed = parse_command([*argv, "--logging.wandb.mode", "disabled"], Options, __doc__.split("\n\n")[0],
                               "launch/benchmark.py", config=True)
        if parsed is None:
            return 0
        a, cfg = parsed
        if a.warmup < 0 or a.steps < 1:
            raise ConfigError(f"--warmup {a.warmup} --steps {a.steps}: need warmup >= 0 and steps >= 1")
        if a.baseline == "plain" and world_from_env().world_size > 1:
            raise ConfigError("--baseline plain measures one device: run it without torchrun")
        result, device, cfg = bench_hybridpar(cfg, a.warmup, a.steps)
        result.update(model=cfg.model.name, seq_len=cfg.train.seq_len, vocab_size=cfg.model.vocab_size,
                      global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size,
                      precision=cfg.train.precision, compile=cfg.train.compile, torch=torch.__version__,
                      date=datetime.date.today().isoformat(), warmup=a.warmup, steps=a.steps)
        _write(result, a.json)  # hybridpar's figures are kept even if the baseline then fails or times out
        if a.baseline == "plain":
            free_device_memory(device)  # the trainer is gone: the baseline starts from an empty device
            result["baseline_tokens_per_sec"] = bench_plain(cfg, device, a.warmup, a.steps)
            result["ratio"] = result["tokens_per_sec"] / result["baseline_tokens_per_sec"]
            _write(result, a.json)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    print(json.dumps(result, indent=1))
    return 0


def _write(result: dict, path: str | None) -> None:
    if path is not None:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
