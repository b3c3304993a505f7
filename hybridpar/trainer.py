"""The trainer: one loop for every layout. It takes a resolved Run (hybridpar.resolve) and the mesh of its degrees;
the data loader takes the data-parallel rank and size; hooks receive the trainer after each step (checkpointing,
extra logging); state_dict() is what a checkpoint keeps of the loop.

Host syncs: none inside a step with the fused AdamW (the default on GPUs): a non-finite gradient norm skips the
update on the device (the optimizer's found_inf, as with a gradient scaler), and the norm with the ranks' stop votes
is read one step late, while the next step runs (or at once before a log row or a checkpoint). The unfused optimizer
(the default on CPU) reads them in the step, since it can only be skipped from the host. Losses stay on the device
until a log step.
"""

from __future__ import annotations

import logging
import math
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from hybridpar.config import Config, merge_windows
from hybridpar.data.dataset import build_training_data
from hybridpar.data.gpt_data import release_index_readers
from hybridpar.planning.flops import flops_per_token as flops_per_token_of, peak_fp8_tflops, peak_tflops
from hybridpar.parallel.distributed import (dp_rank_size, init_mesh, local_tensor, pick_device, set_numerics,
                                            start_process_group, world_from_env)
from hybridpar.errors import ConfigError
from hybridpar.resolve import Run, resolve
from hybridpar.training.lr_schedule import lr_at
from hybridpar.metrics import MetricsLogger, StepProfiler, compile_summary
from hybridpar.training.microbatch import (chunked_loss, count_target_tokens,
                                           forward_backward_no_pipelining, logits_loss)
from hybridpar.models import count_params
from hybridpar.training.optim import build_optimizer, clip_grad_norm, peak_lr_ratio
from hybridpar.inference.in_training import Evaluation
from hybridpar.training.spikes import batch_number, check_skips, windows_of, windows_tensor
from hybridpar.training.step_status import StepStatus
from hybridpar.inference.tasks import load_tasks
from hybridpar.parallel import autocast_for, start_notes
from hybridpar.parallel.fp8 import fp8_scales
from hybridpar.parallel.startup import build_parallel_model


# DTensor warns when a norm reduces over two mesh axes with two all-reduces. Every rank still gets the same value
# (the first all-reduce leaves identical partial sums inside each group), and it happens once per step for the
# gradient norm, so the warning is noise for hybridpar's layouts.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


class Hook(Protocol):
    def on_step_end(self, trainer: "Trainer", step: int) -> None: ...
    def on_train_end(self, trainer: "Trainer") -> None: ...
    # optional: on_gradients(trainer, step), after backward and before clipping (fault-injection drills)


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    unigram_loss: float = float("nan")
    sample: str = ""
    wall_time: float = 0.0
    preempted: bool = False  # stopped early by a signal (after saving, when checkpointing is on)


def start_trainer(cfg: Config, own_run_dir: bool = False, hooks: list[Hook] = ()) -> "Trainer":
    """The one start-up path (launch/pretrain_gpt.py, launch/benchmark.py, benchmarks/): this process's world and
    device, the process group, resolve (hybridpar.resolve), the mesh of its degrees, the Trainer. The model is left
    uninitialised when the run resumes from a checkpoint (run.load_from): each rank then reads its shards into it."""
    world = world_from_env()
    device = pick_device(cfg.train.device, world.local_rank)
    start_process_group(cfg.parallel, device, world)
    try:
        run = resolve(cfg, world, device, own_run_dir=own_run_dir)
    except ConfigError as e:
        e.on_every_rank = True  # resolve compares the ranks' configs first: every rank raised this one
        raise
    try:
        return Trainer(run, init_mesh(run.layout.degrees, device), hooks, init_weights=run.load_from is None)
    except BaseException:
        if run.lock is not None:
            run.lock.release()
        release_index_readers()  # the data a failed start-up opened: megatron-core's readers keep their .idx open
        raise


class Trainer(StepStatus, Evaluation):
    def __init__(self, run: Run, mesh: DeviceMesh, hooks: list[Hook] = (), init_weights: bool = True):
        """The loop of a resolved run on its mesh. init_weights=False leaves the shards uninitialised, for a
        checkpoint to be loaded into."""
        cfg, device = run.cfg, run.device
        self.run, self.cfg, self.mesh, self.device, self.run_dir = run, cfg, mesh, device, run.run_dir
        self.hooks = list(hooks)
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = dp_rank_size(mesh)
        self.tp = mesh["tp"].size()
        set_numerics(cfg.train.deterministic, cfg.train.tf32)
        if cfg.train.compile and self.rank == 0:
            torch._logging.set_logs(recompiles=True)  # a recompilation says which guard failed, when it happens
        self.log: MetricsLogger | None = None  # opened by fit() (or the launcher): a Trainer writes nothing itself
        for note in start_notes(cfg, device):
            self.say(note)
        t0 = time.perf_counter()
        self.data = build_training_data(run, self.dp_rank, self.dp_size)
        self.say(f"start-up: data ready in {time.perf_counter() - t0:.2f}s (indexes, sample order)")
        self.tokenizer = run.tokenizer
        t = cfg.train
        self.tasks = load_tasks(t.eval_tasks, cfg.data)  # read and checked now: a bad task file stops the start
        # Model: built and parallelised on the meta device; this rank materialises and initialises only its shards,
        # with values keyed by global position, so the initial model is bitwise the same for every layout.
        self.model = build_parallel_model(cfg, mesh, device, init=init_weights, report=self.say)
        ns_dtype = torch.bfloat16 if t.precision == "bf16" else torch.float32  # Muon's Newton-Schulz
        self.optimizer = build_optimizer(self.model, cfg.optim, ns_dtype)
        self.fp8_scales = fp8_scales(self.model, cfg)  # float8 all-gathers: the weights' scales, before each forward
        fsdp = isinstance(self.model, FSDPModule)
        self.autocast = autocast_for(self.model, cfg.train.precision, device)
        self.grad_scale = float(self.dp_size) if fsdp else 1.0  # FSDP averages over dp; the loss wants the sum
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            self.loss_context, self.forward_loss = loss_parallel, logits_loss
        else:
            self.loss_context = nullcontext
            fused = t.loss_chunk_tokens and not (t.fp8 != "off" and t.fp8_linears == "all")  # (fp8 head: a module)
            self.forward_loss = partial(chunked_loss, chunk_tokens=t.loss_chunk_tokens) if fused else logits_loss
        self.step = 0  # optimizer steps done
        self.consumed_samples = 0  # samples of all ranks trained so far (step x global batch)
        self.skipped_steps = self.consecutive_skips = 0  # non-finite steps
        # Loss spikes (hybridpar.training.spikes): the batches never trained (data.skip_batches, then each rewind's),
        # the window of earlier (loss, grad norm) the test compares with, the rewinds done, the end of a rewind's
        # learning-rate scaling. All of it is checkpointed: a resumed run decides and trains what this one would.
        self.skip_windows = list(cfg.data.skip_windows)
        self.spike_history: list[tuple[float, float]] = []
        self.rewinds = self.lr_scale_until = 0
        self.spike: tuple[int, str] | None = None  # (step, why) of a spike found, acted on at the step's end
        self.local_stats: dict[int, tuple[float, float]] = {}  # step -> this rank's (loss share, grad shard norm^2)
        self.replaying = False  # a rerun of steps already trained (spike.rerun): nothing logged, nothing tested
        self.rotate_data = False  # spike.rerun=rotate: this step, each data-parallel rank takes its neighbour's batch
        self.rewinder = None  # set by the launcher (hybridpar.checkpoint.rewind.Rewinder) when train.spike=rewind
        self.data.train.order = lambda step: batch_number(step + 1, self.skip_windows) - 1
        self.check_skips([])
        # Set by a signal handler; acted on at the end of the step (after the current microbatch when no checkpoint
        # would be saved: _stop_mid_step).
        self.stop_requested, self.stop_signal = False, 0
        self.stop_voted = False  # some rank asked to stop (settled from a step's status)
        self._pending: list[tuple[int, torch.Tensor]] = []  # (step, status) of steps not yet read on the host
        self._device_skip = all(g.get("fused") for g in self.optimizer.param_groups if not g.get("muon"))
        self.data_wait_seconds = 0.0  # time train steps waited on data since the last log row (read-ahead hides most)
        self.batch_crc32: int | None = None  # CRC-32 of this rank's batch at the last step (metrics: batch_crc32)
        self.flops_per_token = flops_per_token_of(cfg.model, cfg.train.seq_len)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak_tflops = peak_tflops(name)
        self.peak_fp8_tflops = peak_fp8_tflops(name) if cfg.train.fp8 != "off" else None

    def open_log(self, enabled: bool, config_dict: dict | None = None) -> None:
        """Open the metrics logger into the run dir (fit() opens one, enabled on rank 0, when none is open)."""
        self.log = MetricsLogger(self.cfg, self.run_dir, enabled=enabled, config_dict=config_dict)

    def request_stop(self, signum: int) -> None:
        """Stop at the end of this step, or after this microbatch when nothing would be saved (a signal handler)."""
        self.stop_requested, self.stop_signal = True, signum

    # -- what a checkpoint keeps of the loop (hybridpar.checkpoint.dcp saves and restores it) ------------------
    def state_dict(self) -> dict:
        """(With data.stages also stage_origin: [batch, counts...] where the stages were last changed on resume.)"""
        state = {"step": self.step, "consumed_samples": self.consumed_samples, "skipped": self.skipped_steps,
                 "skip_streak": self.consecutive_skips, "skip_windows": windows_tensor(self.skip_windows),
                 "spike_history": torch.tensor(self.spike_history, dtype=torch.float64).reshape(-1, 2),
                 "rewinds": self.rewinds, "lr_scale_until": self.lr_scale_until}
        if self.run.stages is not None:
            state["stage_origin"] = torch.from_numpy(self.data.train.dataset.origin())
        return state

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's trainer state (older checkpoints lack the spike fields). The skipped batches are the
        union of the checkpoint's and this run's data.skip_batches."""
        self.step, self.consumed_samples = int(state["step"]), int(state["consumed_samples"])
        self.skipped_steps, self.consecutive_skips = int(state["skipped"]), int(state.get("skip_streak", 0))
        saved = windows_of(state["skip_windows"]) if "skip_windows" in state else []
        self.skip_windows = merge_windows(saved + list(self.cfg.data.skip_windows))
        self.check_skips(saved)
        history = state.get("spike_history")
        self.spike_history = [] if history is None else [tuple(r) for r in history.reshape(-1, 2).tolist()]
        self.rewinds, self.lr_scale_until = int(state.get("rewinds", 0)), int(state.get("lr_scale_until", 0))

    def check_skips(self, saved: list[tuple[int, int]]) -> None:
        """data.skip_batches against the position (hybridpar.training.spikes.check_skips), on every rank alike."""
        error = check_skips(self.cfg, self.step, saved, self.skip_windows, self.data.train.n_steps)
        if error is not None:
            error.on_every_rank = True  # (every rank checks the same numbers: said once)
            raise error

    def say(self, message: str) -> None:
        """A console line from rank 0, through the metrics logger once fit() (or the launcher) has opened it."""
        if self.log is not None:
            self.log.print(message)
        elif self.rank == 0:
            print(message, flush=True)

    def _stop_mid_step(self) -> bool:
        """Without checkpointing nothing is saved at the step's end: a stop need not wait for it (minutes on CPU)."""
        return self.stop_requested and self.cfg.checkpoint.interval == 0

    # -- collectives over the data-parallel axes -------------------------------------------------------------
    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            for axis in ("dp_replicate", "dp_shard"):
                if self.mesh[axis].size() > 1:
                    dist.all_reduce(t, group=self.mesh[axis].get_group())
        return t

    # -- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One optimizer step. Returns (loss share, grad norm, lr), the first two on the device. A non-finite
        gradient norm skips the optimizer update; the norm and the ranks' stop votes are read by settle()."""
        # Random numbers (dropout) come from (seed, step): a resumed run draws exactly what the uninterrupted one did.
        torch.manual_seed(self.cfg.train.seed * 1_000_003 + step)
        lr = lr_at(step, self.cfg.optim, self.cfg.train.steps)
        if self.fp8_scales is not None:
            self.fp8_scales()
        if step < self.lr_scale_until:  # the steps after a rewind (spike.lr_scale, spike.lr_steps)
            lr *= self.cfg.spike.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr * peak_lr_ratio(group, self.cfg.optim)
        t0 = time.perf_counter()
        # Copied to the device at once, asynchronously (the loader pins them on a GPU), so the target-token count
        # below is computed there: counting on the host first would make its copy a blocking one.
        loader = self.data.train
        batch = loader.load(loader.order(step), rank_shift=1) if self.rotate_data else loader.microbatches(step)
        microbatches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                        for x, y in batch]
        self.data_wait_seconds += time.perf_counter() - t0
        self.batch_crc32 = self.data.train.crc32.pop(self.data.train.order(step), None)
        # Target tokens of the whole global batch, as a device tensor: summed over dp ranks without a host sync.
        n_tokens = self._dp_sum(count_target_tokens(microbatches).float())
        loss = forward_backward_no_pipelining(self.model, microbatches, n_tokens, self.device,
                                              forward_loss=self.forward_loss, grad_scale=self.grad_scale,
                                              autocast=self.autocast, loss_context=self.loss_context,
                                              stop_now=self._stop_mid_step,
                                              accumulate_unsharded=self.cfg.parallel.accumulate_unsharded)
        for hook in self.hooks:
            if hasattr(hook, "on_gradients"):
                hook.on_gradients(self, step + 1)
        if self.cfg.spike.rerun != "off":  # this rank's own numbers, for a rerun to compare with
            shard_sq = sum((local_tensor(p.grad).float() ** 2).sum() for p in self.model.parameters() if p.grad is not None)
            self.local_stats[step + 1] = torch.stack([loss.detach().float().reshape(()), shard_sq])
        grad_norm = clip_grad_norm(self.model, self.cfg.train.grad_clip).reshape(()).float()
        # (norm, stop vote, global loss when spikes are tested): settled by settle(), now or one step late
        parts = [grad_norm, self._stop_vote()]
        if self.cfg.train.spike != "off":
            parts.append(self._dp_sum(loss.detach().clone().float().reshape(())))
        status = torch.stack(parts)
        self._pending.append((step + 1, status))
        if self._device_skip:  # the fused kernel skips the whole update when found_inf is nonzero: no host read
            self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
            self.optimizer.step()
        elif self.settle():  # the unfused optimizer can only be skipped from the host: read the status now
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.consumed_samples += self.cfg.train.global_batch_size
        return loss, grad_norm, lr

    def _stop_vote(self) -> torch.Tensor:
        """1.0 on every rank when any rank was asked to stop, on the device (a fill kernel, not a host copy)."""
        flag = torch.full((), float(self.stop_requested), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        if self.log is None:
            self.open_log(enabled=self.rank == 0)
        result = TrainResult(unigram_loss=self.data.unigram_loss)
        tokens_per_step = t.global_batch_size * t.seq_len
        self.log.print(
            f"model {cfg.model.name}: {count_params(self.model) / 1e6:.2f}M parameters | device {self.device} "
            + (f"x {torch.get_num_threads()} thread(s) " if self.device.type == "cpu" else "")
            + f"({cfg.train.precision}) | mesh {dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))}\n"
            f"data {self.data.description}: {self.data.samples_line(t.steps * t.global_batch_size, t.seq_len + 1)}, "
            f"split {cfg.data.split}, tokenizer {cfg.data.tokenizer} "
            f"({self.tokenizer.vocab_size} tokens; model vocab {cfg.model.vocab_size})\n"
            f"batch {t.global_batch_size} x {t.seq_len} = {tokens_per_step:,} tokens/step, "
            f"{self.run.microbatches} microbatch(es) of {t.micro_batch_size} per rank"
            + (f" | unigram baseline {result.unigram_loss:.3f} nats/token" if math.isfinite(result.unigram_loss)
               else ""))
        if self.run.layout_choice:
            self.log.print(self.run.layout_choice)
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        self.log.print(f"{len(hosts)} rank(s) on {len(set(hosts))} host(s): "
                       + ", ".join(f"{h} x{hosts.count(h)}" for h in dict.fromkeys(hosts)))
        start = time.perf_counter()
        if t.eval_interval and self.step == 0 and t.steps > 0:  # (a seed-checkpoint start skips it)
            self._validate()
        if self.tasks and self.step == 0 and t.steps > 0:
            self._eval_tasks()
        last_time, last_step = time.perf_counter(), self.step
        first_step = self.step + 1
        profile_range, profiler = cfg.profile.range, None
        while self.step < t.steps and not self.stop_voted:  # (a stop during the first validation: no step)
            if profile_range and self.step + 1 == profile_range[0]:
                profiler = StepProfiler(cfg.profile, self.device, self.run_dir / "profile", self.rank)
            loss, grad_norm, lr = self.train_step(self.step)
            self.step += 1
            done = self.step == t.steps
            log_now = self.step % cfg.logging.interval == 0 or done
            # The previous step's status is read while this one runs; all of it before a log row or at the end.
            self.settle(keep_last=not log_now)
            stop = self.stop_voted
            if self.step == first_step and not log_now:
                # The first step of this start is slow (allocations, kernel selection, compile): say it ended.
                self.say(f"step {self.step}: first step done in {time.perf_counter() - last_time:.1f}s (loss "
                         f"{float(self._dp_sum(loss.clone())):.4f}); next lines every {cfg.logging.interval} steps")
            if self.step == first_step and t.compile:
                self.say(compile_summary())
            if profiler is not None and self.step == profile_range[1]:
                self.log.print(profiler.stop(profile_range))
                profiler = None
            if log_now or stop:
                loss_value = float(self._dp_sum(loss))  # the one host sync of the interval
                now = time.perf_counter()
                elapsed, steps = now - last_time, self.step - last_step
                result.losses[self.step] = loss_value
                self.log.log(self._metrics(loss_value, lr, float(grad_norm), elapsed, steps, tokens_per_step))
                last_time, last_step = now, self.step
            if t.eval_interval and (self.step % t.eval_interval == 0 or done):
                self._validate()
                last_time = time.perf_counter()  # validation time is not training throughput
                stop = stop or (self.stop_voted and not done)  # a signal during validation
            every = t.eval_tasks_interval
            if self.tasks and (done or every and self.step % every == 0) and not self.stop_voted:
                self._eval_tasks()
                last_time = time.perf_counter()
                stop = stop or (self.stop_voted and not done)
            for hook in self.hooks:
                hook.on_step_end(self, self.step)
            if self.spike is not None and self.rewinder is None:
                self.spike = None  # (a trainer without checkpoints to go back to: the warning was all)
            if self.spike is not None:
                self.rewinder.rewind(self)  # back to a checkpoint (or on from a rerun), the spike's batches skipped
                last_time, last_step = time.perf_counter(), self.step
                continue
            if stop:
                result.preempted = True
                self.log.print(f"stop requested: leaving after step {self.step}")
                break
        self.settle()
        result.preempted |= self.step < t.steps  # (stopped during the first validation: no break above)
        result.wall_time = time.perf_counter() - start
        if t.sample_tokens and not result.preempted and self.step > 0:  # no sample of an untrained model
            result.sample = self.sample(t.sample_prompt, t.sample_tokens, t.sample_temperature)
            self.log.print(f"sample (temperature {t.sample_temperature}):\n{result.sample}")
        for hook in self.hooks:
            hook.on_train_end(self)
        self.log.print(f"done: {self.step} steps in {result.wall_time:.1f}s")
        self.close()
        return result

    def close(self) -> None:
        """Closes the metrics log (once opened) and the data; fit() calls it on its way out, the launcher after an
        error; a second call does nothing."""
        if self.log is not None:
            self.log.close()
        self.data.close()

    def _metrics(self, loss: float, lr: float, grad_norm: float, elapsed: float, steps: int,
                 tokens_per_step: int) -> dict:
        """The row of a logging step; see docs/metrics.md for every field."""
        world = dist.get_world_size()
        step_time = elapsed / steps
        # Straggler view: the slowest and fastest rank's mean step time over the interval.
        spread = torch.tensor([step_time, -step_time], dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        staged, flops_per_token = {}, self.flops_per_token
        if self.run.stages is not None:  # stage, samples per source, tokens; the last batch's sequence length
            staged = self.data.train.dataset.row(self.data.train.order(self.step - 1) + 1, self.skip_windows)
            tokens_per_step = self.cfg.train.global_batch_size * staged["seq_len"]
            flops_per_token = flops_per_token_of(self.cfg.model, staged["seq_len"])
        tps = steps * tokens_per_step / elapsed
        per_device = tps / world
        tflops = flops_per_token * per_device / 1e12
        row = {"step": self.step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
               "tokens_per_sec_per_device": per_device, "tflops_per_device": tflops, "step_time": step_time,
               "step_time_max": float(spread[0]), "step_time_min": -float(spread[1]),
               "data_time": min(1.0, self.data_wait_seconds / elapsed), "consumed_tokens": self.step * tokens_per_step,
               "skipped_steps": self.skipped_steps, "batch_crc32": self.batch_crc32, **staged}
        if self.peak_tflops:
            row["mfu"] = tflops / self.peak_tflops
        if self.peak_fp8_tflops:
            row["mfu_fp8"] = tflops / self.peak_fp8_tflops
        if self.device.type == "cuda":
            gib = 2 ** 30
            row.update(mem_allocated_gib=torch.cuda.memory_allocated(self.device) / gib,
                       mem_reserved_gib=torch.cuda.memory_reserved(self.device) / gib,
                       mem_peak_gib=torch.cuda.max_memory_allocated(self.device) / gib)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.data_wait_seconds = 0.0
        return row
