"""Where metrics go: <run.dir>/metrics.jsonl (the source of truth), the console, W&B, and TensorBoard if asked.

Only the logging rank (global rank 0) writes; the other ranks get a logger that drops everything. W&B defaults to
offline unless an API key is configured, so a compute node without internet never fails a run; a resumed run
passes the W&B run id its checkpoint recorded and logs its steps explicitly, continuing the same run. The API key
is read by wandb from its own environment/netrc and never enters hybridpar's config, logs or metrics.
"""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
from pathlib import Path

from hybridpar.config import Config, ProfileConfig
from hybridpar.errors import ConfigError, RunDirError, first_line


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


WANDB_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")  # what wandb accepts in WANDB_MODE


def wandb_mode(configured: str | None) -> str:
    """logging.wandb.mode; else WANDB_MODE from the environment; else online when an API key is available and
    offline otherwise. A WANDB_MODE wandb would refuse (even beside an explicit mode) is a ConfigError."""
    env = os.environ.get("WANDB_MODE")
    if env is not None and env not in WANDB_MODES and configured != "disabled":
        raise ConfigError(f"WANDB_MODE={env!r} in the environment is not a W&B mode (wandb refuses to start with "
                          f"it); unset it, or set it to online, offline or disabled")
    if configured is not None:
        return configured
    if env:
        return {"dryrun": "offline", "run": "online", "shared": "online"}.get(env, env)
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        rc = netrc.netrc()
        return "online" if rc.authenticators("api.wandb.ai") else "offline"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return "offline"


RECORD_ONLY = ("batch_crc32",)  # metrics.jsonl only: an identifier, not a series to plot in W&B or TensorBoard


class MetricsLogger:
    """Appends one JSON object per call to metrics.jsonl, prints a console line, forwards to W&B / TensorBoard."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, config_dict: dict | None = None, out=None):
        # out: the stream console lines go to; None = sys.stdout as it is now (not as it was at import)
        self.enabled, self.out, self.total_steps = enabled, out if out is not None else sys.stdout, cfg.train.steps
        self.file = None
        self.wandb_run = self.tensorboard = None
        self.wandb_step = 0
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        w = cfg.logging.wandb
        mode = wandb_mode(w.mode)
        if mode != "disabled":
            import wandb

            def init(mode: str, **settings):
                resume = {"resume": "allow"} if w.id and mode == "online" else {}
                return wandb.init(mode=mode, project=w.project, entity=w.entity, id=w.id, name=w.name or cfg.run.name,
                                  group=w.group, tags=w.tags or None, dir=w.dir or str(run_dir), config=config_dict,
                                  settings=wandb.Settings(console="off", silent=True, **settings), **resume)

            if mode == "online" and w.mode is None and not os.environ.get("WANDB_MODE"):
                # online only because a key exists: a node that cannot reach W&B logs offline rather than failing
                try:
                    self.wandb_run = init(mode, init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)))
                except wandb.errors.Error as e:
                    self.print(f"W&B unreachable ({first_line(e)}); logging offline instead")
                    mode = "offline"
            if self.wandb_run is None:
                self.wandb_run = init(mode)
            self.print(f"W&B {mode} run {self.wandb_run.id}" + (
                f": upload later with `wandb sync {self.wandb_run.dir.rsplit('/files', 1)[0]}`" if mode == "offline" else ""))
        if cfg.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError("logging.tensorboard=true needs the tensorboard package: pip install tensorboard") from None
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))

    @property
    def wandb_id(self) -> str | None:
        return self.wandb_run.id if self.wandb_run is not None else None

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.out, flush=True)

    def log(self, row: dict) -> None:
        """Record one row: {"step": int, ...}. Training rows (with "loss") also print a console line."""
        if not self.enabled:
            return
        try:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk (or quota): one line; the checkpoints already complete are intact
            f, self.file = self.file, None
            try:
                f.close()  # closed even when its last flush fails: no second error at exit
            except OSError:
                pass
            raise RunDirError(f"{f.name}: {e.strerror.lower()} while writing the metrics of step {row['step']}; free "
                              f"space there, then start the same command again (it resumes from the latest "
                              f"complete checkpoint)") from None
        series = {k: v for k, v in row.items() if k != "step" and k not in RECORD_ONLY}
        if self.wandb_run is not None and row["step"] >= self.wandb_step:
            # W&B's step only grows: steps trained again after a rewind are in metrics.jsonl, not W&B
            self.wandb_run.log(series, step=row["step"])
            self.wandb_step = row["step"]
        if self.tensorboard is not None:
            for k, v in series.items():
                if isinstance(v, (int, float)):
                    self.tensorboard.add_scalar(k, v, row["step"])
        if "loss" in row:
            eta = row.get("step_time", float("nan")) * (self.total_steps - row["step"])
            mfu = f" | MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            mfu += f" | stage {row['stage']}" if "stage" in row else ""
            self.print(f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps} | "
                       f"loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f} | "
                       f"{row['tokens_per_sec']:,.0f} tok/s{mfu} | ETA {_fmt_eta(eta)}")
        elif "val_loss" in row:
            self.print(f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps} | "
                       f"val_loss {row['val_loss']:.4f} | val_ppl {row['val_ppl']:.1f}")

    def close(self) -> None:
        """Closes every sink once (a second call, from the launcher's clean-up after an error, does nothing)."""
        file, board, run = self.file, self.tensorboard, self.wandb_run
        self.file = self.tensorboard = self.wandb_run = None
        if file is not None:
            file.close()
        if board is not None:
            board.close()
        if run is not None:
            run.finish()


def compile_summary() -> str:
    """torch.compile's work so far, in one line: graphs compiled and graph breaks, with their reasons. Each later
    recompilation prints its guard failure as it happens (torch._logging recompiles, set at start-up)."""
    from torch._dynamo.utils import counters

    breaks = counters["graph_break"]
    line = f"compile: {counters['stats']['unique_graphs']} graph(s), {sum(breaks.values())} graph break(s)"
    if breaks:
        line += " | breaks: " + "; ".join(f"{reason} (x{n})" for reason, n in breaks.most_common(3))
    return line


class StepProfiler:
    """torch.profiler over a range of steps (profile.steps), and with profile.memory_snapshot on CUDA the memory
    history of those steps: a Chrome trace per rank (Perfetto, chrome://tracing, TensorBoard) under `out`. The loop
    calls before() and after() around every step; only the range's steps are profiled."""

    def __init__(self, cfg: ProfileConfig, device, out: Path, rank: int):
        self.range, self.cuda, self.out, self.rank = cfg.range, device.type == "cuda", out, rank
        self.memory = cfg.memory_snapshot and self.cuda
        self.profiler = None

    def before(self, step: int) -> None:
        """Step `step` (1-based) is about to run: the profile starts before the range's first."""
        if not self.range or step != self.range[0]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, record_shapes=True)
        self.profiler.__enter__()
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=200_000)

    def after(self, step: int) -> str | None:
        """Step `step` ran: after the range's last, the trace (and snapshot) written and the console line saying
        where; None otherwise."""
        if self.profiler is None or step != self.range[1]:
            return None
        import torch

        profiler, self.profiler, steps = self.profiler, None, self.range
        profiler.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.steps{steps[0]}-{steps[1]}"
        profiler.export_chrome_trace(str(self.out / f"{name}.pt.trace.json"))
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.out / f"{name}.memory.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        return f"profile of steps {steps[0]}-{steps[1]} written to {self.out}"


def start_lines(run, model, mesh, data, unigram: float) -> list[str]:
    """What a training run says before its first step: model, device and mesh; data; batch; the layout chosen; the
    ranks' hosts (collective)."""
    import socket

    import torch
    import torch.distributed as dist

    from hybridpar.models import count_params

    cfg, t, device = run.cfg, run.cfg.train, run.device
    lines = [
        f"model {cfg.model.name}: {count_params(model) / 1e6:.2f}M parameters | device {device} "
        + (f"x {torch.get_num_threads()} thread(s) " if device.type == "cpu" else "")
        + f"({t.precision}) | mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))}\n"
        f"data {data.description}: {data.samples_line(t.steps * t.global_batch_size, t.seq_len + 1)}, "
        f"split {cfg.data.split}, tokenizer {cfg.data.tokenizer} "
        f"({run.tokenizer.vocab_size} tokens; model vocab {cfg.model.vocab_size})\n"
        f"batch {t.global_batch_size} x {t.seq_len} = {t.global_batch_size * t.seq_len:,} tokens/step, "
        f"{run.microbatches} microbatch(es) of {t.micro_batch_size} per rank"
        + (f" | unigram baseline {unigram:.3f} nats/token" if math.isfinite(unigram) else "")]
    if run.layout_choice:
        lines.append(run.layout_choice)
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    lines.append(f"{len(hosts)} rank(s) on {len(set(hosts))} host(s): "
                 + ", ".join(f"{h} x{hosts.count(h)}" for h in dict.fromkeys(hosts)))
    return lines
