"""The trainer: one loop for every layout. It takes a resolved Run (hybridpar.resolve) and the mesh of its degrees,
builds its data and model, and owns its parts: the loop's record (TrainState, what a checkpoint keeps, a resume or a
rewind replaces), the queue of step statuses, the evaluator, and, in a training run (hybridpar.session), the
checkpointer and the host copies a spike rewind goes back to. The parts are given what they need and return
decisions; the loop acts on them.

Host syncs: none inside a step with the fused AdamW (the default on GPUs): a non-finite gradient norm skips the
update on the device (the optimizer's found_inf, as with a gradient scaler), and the norm with the ranks' stop votes
is read one step late, while the next step runs (or at once before a log row or a checkpoint). The unfused optimizer
(the default on CPU) reads them in the step, since it can only be skipped from the host. Losses stay on the device
until a log step.
"""

from __future__ import annotations

import math
import socket
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from hybridpar.checkpoint.layout import (checkpoint_dir, is_complete, latest_checkpoint, list_checkpoints,
                                        remove_step_dir, step_of)
from hybridpar.checkpoint.rewind import plan_rewind, rerun_verdict, write_skipped
from hybridpar.config import merge_windows
from hybridpar.data.dataset import build_training_data
from hybridpar.inference.evaluate import metrics_row, summary
from hybridpar.inference.in_training import Evaluator
from hybridpar.inference.tasks import load_tasks
from hybridpar.metrics import MetricsLogger, StepProfiler, compile_summary
from hybridpar.models import count_params
from hybridpar.parallel import autocast_for, start_notes
from hybridpar.parallel.distributed import dp_rank_size, local_tensor, set_numerics
from hybridpar.parallel.fp8 import fp8_scales
from hybridpar.parallel.startup import build_parallel_model, plain_name
from hybridpar.planning.flops import flops_per_token as flops_per_token_of, peak_fp8_tflops, peak_tflops
from hybridpar.resolve import Run
from hybridpar.training.goodput import Goodput
from hybridpar.training.lr_schedule import lr_at
from hybridpar.training.microbatch import (chunked_loss, count_target_tokens, forward_backward_no_pipelining,
                                           logits_loss)
from hybridpar.training.optim import build_optimizer, clip_grad_norm, peak_lr_ratio
from hybridpar.training.spikes import HostCopies, check_skips, find_spike, windows_text
from hybridpar.data.record import extend, segment
from hybridpar.training.state import TrainState
from hybridpar.training.step_status import StatusQueue, StepReading, TrainingDiverged

LOCAL_STATS_STEPS = 10_000  # steps of this rank's own numbers kept for spike.rerun (a rerun compares those it has)


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    unigram_loss: float = float("nan")
    sample: str = ""
    wall_time: float = 0.0
    preempted: bool = False  # stopped early by a signal (after saving, when checkpointing is on)


@dataclass(frozen=True)
class StepNumerics:
    """How a forward runs and its loss is taken on this layout (training and evaluation alike)."""
    autocast: Callable  # the forward's context (bf16 autocast where FSDP does not cast already)
    forward_loss: Callable  # (model, x, y) -> token-loss sum
    loss_context: Callable  # loss_parallel under tensor parallelism
    grad_scale: float  # FSDP averages gradients over dp; the loss wants their sum
    fp8_scales: Callable | None  # float8 all-gathers: the weights' scales, computed before each forward

    @classmethod
    def of(cls, cfg, model, tp: int, dp_size: int, device: torch.device) -> "StepNumerics":
        t = cfg.train
        if tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            loss_context, forward_loss = loss_parallel, logits_loss
        else:
            loss_context = nullcontext
            fused = t.loss_chunk_tokens and not (t.fp8 != "off" and t.fp8_linears == "all")  # (fp8 head: a module)
            forward_loss = partial(chunked_loss, chunk_tokens=t.loss_chunk_tokens) if fused else logits_loss
        # FSDP averages over dp; the loss wants the sum (parallel.exact_reduction's reduce-scatter sums itself)
        fsdp_average = isinstance(model, FSDPModule) and not cfg.parallel.exact_reduction
        return cls(autocast_for(model, t.precision, device), forward_loss, loss_context,
                   float(dp_size) if fsdp_average else 1.0, fp8_scales(model, cfg))


class Trainer:
    def __init__(self, run: Run, mesh: DeviceMesh, init_weights: bool = True, checkpointer=None,
                 copies: HostCopies | None = None):
        """The loop of a resolved run on its mesh. init_weights=False leaves the shards uninitialised, for a
        checkpoint to be loaded into. Without a checkpointer (hybridpar.checkpoint.dcp) nothing is saved and a
        loss spike is only reported; `copies` keeps the newest checkpoints in host memory for rewinds."""
        cfg, device = run.cfg, run.device
        self.run, self.cfg, self.mesh, self.device, self.run_dir = run, cfg, mesh, device, run.run_dir
        self.rank = dist.get_rank()
        self.dp_rank, self.dp_size = dp_rank_size(mesh)
        set_numerics(cfg.train.deterministic, cfg.train.tf32)
        if cfg.train.compile and self.rank == 0:
            torch._logging.set_logs(recompiles=True)  # a recompilation says which guard failed, when it happens
        self.log: MetricsLogger | None = None  # opened by fit() (or the session): a Trainer writes nothing itself
        for note in start_notes(cfg, device):
            self.say(note)
        t0 = time.perf_counter()
        self.data = build_training_data(run, self.dp_rank, self.dp_size)
        self.say(f"start-up: data ready in {time.perf_counter() - t0:.2f}s (indexes, sample order)")
        self.tokenizer = run.tokenizer
        tasks = load_tasks(cfg.train.eval_tasks, cfg.data)  # read and checked now: a bad task file stops the start
        # Model: built and parallelised on the meta device; this rank materialises and initialises only its shards,
        # with values keyed by global position, so the initial model is bitwise the same for every layout.
        self.model = build_parallel_model(cfg, mesh, device, init=init_weights, report=self.say)
        ns_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32  # Muon's Newton-Schulz
        self.optimizer = build_optimizer(self.model, cfg.optim, ns_dtype)
        self.numerics = StepNumerics.of(cfg, self.model, mesh["tp"].size(), self.dp_size, device)
        self.exact = None
        if cfg.parallel.exact_reduction:  # (its module imports torch-private FSDP classes: only when on)
            from hybridpar.parallel.exact import ExactGradients

            names = {id(p): plain_name(n) for n, p in self.model.named_parameters()}
            self.exact = ExactGradients(self.model, mesh, names)
        self.exact_replays = 0  # steps parallel.exact_reduction replayed on a coarser grid since this start (logged)
        self.evaluator = Evaluator(cfg, self.model, mesh, device, self.tokenizer, self.numerics, self.data, tasks,
                                   self._dp_sum, self._poll_stop)
        self.checkpointer, self.copies = checkpointer, copies if copies is not None else HostCopies(0)
        self._last_saved = -1  # the step of the newest checkpoint this process saved
        self.start_segment = segment(cfg, 0, self.data.prefixes)  # what this start reads (hybridpar.data.record)
        self.state = TrainState(skip_windows=list(cfg.data.skip_windows), data_segments=[self.start_segment])
        self.status = StatusQueue()
        self._device_skip = all(g.get("fused") for g in self.optimizer.param_groups if not g.get("muon"))
        self.check_skips([])
        # Loss spikes: (step, why) of a spike found, acted on at the step's end; this rank's (loss share, gradient
        # shard norm^2) by step, which a rerun compares; whether steps are being replayed (nothing tested then).
        self.spike: tuple[int, str] | None = None
        self.local_stats: dict[int, tuple[float, float]] = {}
        self.replaying = False
        # Set by a signal handler (request_stop); acted on at the end of the step (after the current microbatch when
        # no checkpoint would be saved: _stop_mid_step). stop_voted: some rank asked (read from a step's status).
        self.stop_requested, self.stop_signal, self.stop_voted = False, 0, False
        self.data_wait_seconds = 0.0  # time train steps waited on data since the last log row (read-ahead hides most)
        self.data_wait_total = 0.0  # and since the start (the goodput record's data_wait)
        self.goodput: Goodput | None = None  # fit()'s time accounting (hybridpar.training.goodput)
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

    def take_data_wait(self) -> float:
        """The seconds train steps waited on data since the last call (or log row); counting starts again."""
        seconds, self.data_wait_seconds = self.data_wait_seconds, 0.0
        return seconds

    # -- the loop's position: what a checkpoint keeps, what a resume and a rewind replace ------------------------
    def position(self) -> dict:
        """The TrainState's entries, with a staged run's stage_origin ([batch, counts...] where the stages were
        last changed on resume)."""
        state = self.state.state_dict()
        if self.run.stages is not None:
            state["stage_origin"] = torch.from_numpy(self.data.train.dataset.origin())
        return state

    def resume(self, path, weights_only: bool = False, skipped: tuple[list, int] = ([], 0)) -> list[str]:
        """Load checkpoint `path` (its weights only, with weights_only) and continue from its position: the skipped
        batches are the union of the checkpoint's, this run's data.skip_batches and `skipped` (the windows and rewind
        count the run dir recorded since that checkpoint). Returns the data settings that changed."""
        from hybridpar.checkpoint.resume_checks import stage_origin

        saved, changes = self.checkpointer.load(path, self.model, self.optimizer, self.position(), weights_only)
        if saved is None:
            return changes
        state = TrainState.of(saved)
        now = {**self.start_segment, "from_step": state.step}
        state.data_segments = extend(state.data_segments, now, self.cfg.checkpoint.allow_data_change, path)
        windows = list(state.skip_windows)
        state.skip_windows = merge_windows(windows + list(self.cfg.data.skip_windows))
        self.state = state
        self.check_skips(windows)
        if self.run.stages is not None:  # each source continues where it was, also after a change of stages
            origin = stage_origin(path, self.cfg, self.run.stages, saved.get("stage_origin"),
                                  state.batch_for(state.step))
            if origin is not None:
                self.data.train.dataset.restart_at(*origin)
                state.data_segments[-1] = {**state.data_segments[-1],  # (provenance rebuilds the sampler from it)
                                           "stage_origin": [int(origin[0]), *map(int, origin[1])]}
        self._check_recorded_skips(skipped[0])
        state.skip_windows = merge_windows(state.skip_windows + list(skipped[0]))
        state.rewinds = max(state.rewinds, skipped[1])
        return changes

    def _check_recorded_skips(self, recorded: list[tuple[int, int]]) -> None:
        """The windows the run dir's skipped_batches.json holds lie where this run's rewinds can reach: at most
        spike.max_rewinds x spike.skip batches past the last step's batch (a rewind skips batches of steps it ran)."""
        from hybridpar.checkpoint.rewind import SKIPPED_FILE
        from hybridpar.errors import CheckpointError

        s, state, where = self.cfg.spike, self.state, self.run_dir / SKIPPED_FILE
        reach = state.batch_for(self.cfg.train.steps - 1) + 1 + s.max_rewinds * s.skip
        far = [w for w in recorded if w[1] > reach]
        if far:
            raise CheckpointError(f"{where} records skipped batches {windows_text(far)}, past batch {reach:,}, the "
                                  f"last this run's rewinds can reach: the file is damaged; delete it to resume with "
                                  f"the checkpoint's own skipped batches")
        # A rewind records batches after the checkpoint it goes back to; those the checkpoint trained past are in its
        # own windows (it was saved after that rewind), or the file belongs to another history.
        trained = state.batch_for(state.step - 1) + 1 if state.step else 0  # the last batch trained, 1-based
        held = [(a, min(b, trained)) for a, b in recorded if a <= trained]
        other = [w for w in held if not any(c <= w[0] and w[1] <= d for c, d in state.skip_windows)]
        if other:
            raise CheckpointError(f"{where} records skipped batches {windows_text(other)}, which the checkpoint (step "
                                  f"{state.step}, batch {trained}) trained: the file belongs to another history; "
                                  f"delete it to resume with the checkpoint's own skipped batches")

    def check_skips(self, saved: list[tuple[int, int]]) -> None:
        """data.skip_batches against the position (hybridpar.training.spikes.check_skips), on every rank alike."""
        error = check_skips(self.cfg, self.state.step, saved, self.state.skip_windows, self.data.train.n_steps)
        if error is not None:
            error.on_every_rank = True  # (every rank checks the same numbers: said once)
            raise error

    def say(self, message: str) -> None:
        """A console line from rank 0, through the metrics logger once fit() (or the session) has opened it."""
        if self.log is not None:
            self.log.print(message)
        elif self.rank == 0:
            print(message, flush=True)

    def _log(self, row: dict) -> None:
        if self.log is not None:
            self.log.log(row)

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

    def _stop_vote(self) -> torch.Tensor:
        """1.0 on every rank when any rank was asked to stop, on the device (a fill kernel, not a host copy)."""
        flag = torch.full((), float(self.stop_requested), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def _poll_stop(self) -> bool:
        """Whether any rank asked to stop, read now (between two evaluation batches or tasks)."""
        self.stop_voted = self.stop_voted or bool(self._stop_vote())
        return self.stop_voted

    # -- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, step: int, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Optimizer step step + 1 (`step` are done). Returns (loss share, grad norm, lr), the first two on the
        device. A non-finite gradient norm skips the optimizer update; the norm and the ranks' stop votes are read
        by read_status(). rotate: each data-parallel rank trains its neighbour's batch (a spike.rerun=rotate
        replay)."""
        cfg, n = self.cfg, self.numerics
        # Random numbers (dropout) come from (seed, step): a resumed run draws exactly what the uninterrupted one did.
        torch.manual_seed(cfg.train.seed * 1_000_003 + step)
        lr = lr_at(step, cfg.optim, cfg.train.steps)
        if n.fp8_scales is not None:
            n.fp8_scales()
        if step < self.state.lr_scale_until:  # the steps after a rewind (spike.lr_scale, spike.lr_steps)
            lr *= cfg.spike.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr * peak_lr_ratio(group, cfg.optim)
        t0 = time.perf_counter()
        # Copied to the device at once, asynchronously (the loader pins them on a GPU), so the target-token count
        # below is computed there: counting on the host first would make its copy a blocking one.
        loader, batch = self.data.train, self.state.batch_for(step)
        host = loader.load(batch, rank_shift=1) if rotate else loader.microbatches(step, self.state.batch_for)
        microbatches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                        for x, y in host]
        self.data_wait_seconds += time.perf_counter() - t0
        self.data_wait_total += time.perf_counter() - t0
        self.batch_crc32 = loader.crc32.pop(batch, None)
        # Target tokens of the whole global batch, as a device tensor: summed over dp ranks without a host sync.
        n_tokens = self._dp_sum(count_target_tokens(microbatches).float())
        while True:
            if self.exact is not None:
                self.exact.begin(self.state.exact_bounds)
            loss = forward_backward_no_pipelining(self.model, microbatches, n_tokens, self.device,
                                                  forward_loss=n.forward_loss, grad_scale=n.grad_scale,
                                                  autocast=n.autocast, loss_context=n.loss_context,
                                                  stop_now=self._stop_mid_step,
                                                  accumulate_unsharded=cfg.parallel.accumulate_unsharded,
                                                  exact=self.exact)
            if self.exact is None:
                break
            done, self.state.exact_bounds = self.exact.finish()
            if done:
                break
            self.exact_replays += 1
            torch.manual_seed(cfg.train.seed * 1_000_003 + step)  # the replay draws what the first pass drew
        local = None
        if cfg.spike.rerun != "off":  # this rank's own numbers, for a rerun to compare with
            shard_sq = sum((local_tensor(p.grad).float() ** 2).sum() for p in self.model.parameters()
                           if p.grad is not None)
            local = torch.stack([loss.detach().float().reshape(()), shard_sq])
        grad_norm = clip_grad_norm(self.model, cfg.train.grad_clip,
                                   self.exact.grad_norm if self.exact is not None else None).reshape(()).float()
        # (norm, stop vote, global loss when spikes are tested): read by read_status(), now or one step late
        parts = [grad_norm, self._stop_vote()]
        if cfg.train.spike != "off":
            parts.append(self._dp_sum(loss.detach().clone().reshape(())).float())  # (exact mode: summed in float64)
        self.status.push(step + 1, torch.stack(parts), local)
        if self._device_skip:  # the fused kernel skips the whole update when found_inf is nonzero: no host read
            self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
            self.optimizer.step()
        elif self.read_status():  # the unfused optimizer can only be skipped from the host: read the status now
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm, lr

    def advance(self, step: int, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Train step step + 1 and move the position past it."""
        out = self.train_step(step, rotate)
        self.state.step += 1
        self.state.consumed_samples += self.cfg.train.global_batch_size
        return out

    # -- what the loop reads back of its steps -----------------------------------------------------------------
    def read_status(self, keep_last: bool = False) -> bool:
        """Read the pending steps' statuses, oldest first, and act on them: count a non-finite step as skipped (its
        update was not applied) and warn, raise TrainingDiverged past train.max_skipped_steps, test a finite one
        for a loss spike, note a stop vote. keep_last leaves the newest step pending (its kernels may still run).
        Returns whether the last step read was finite (True when none was read)."""
        finite = True
        for reading in self.status.read(keep_last):
            finite = self._act_on(reading)
        return finite

    def _act_on(self, r: StepReading) -> bool:
        s, limit = self.state, self.cfg.train.max_skipped_steps
        if r.local is not None:
            self.local_stats[r.step] = r.local
            self.local_stats.pop(r.step - LOCAL_STATS_STEPS, None)
        finite = math.isfinite(r.grad_norm)
        if finite and r.loss is not None:
            self._test_spike(r.step, r.loss, r.grad_norm)
        if finite:
            s.skip_streak = 0
        else:
            s.skipped += 1
            s.skip_streak += 1
            if self.goodput is not None:
                self.goodput.skipped(r.step)
            self.say(f"warning: step {r.step}: gradient norm is {r.grad_norm}; optimizer step skipped "
                     f"({s.skip_streak} in a row, {s.skipped} in total)")
            if s.skip_streak > limit:
                raise TrainingDiverged(f"{s.skip_streak} non-finite steps in a row (more than train.max_skipped_steps="
                                       f"{limit}); the last complete checkpoint is intact: lower optim.lr or check "
                                       f"the data, then resume")
        self.stop_voted = self.stop_voted or r.stop_voted
        return finite

    def _test_spike(self, step: int, loss: float, norm: float) -> None:
        """The spike test of a finite step (train.spike warn or rewind): a spike is reported (and, with rewind, acted
        on at the end of the step) and kept out of the window; other steps enter it."""
        window = self.cfg.spike.window
        why = None if self.replaying or self.spike is not None else find_spike(self.cfg.spike,
                                                                               self.state.spike_history, loss, norm)
        if why is None:
            if self.spike is None or self.replaying:
                self.state.spike_history = (self.state.spike_history + [(loss, norm)])[-window:]
            return
        self.say(f"warning: step {step}: loss spike: {why}"
                 + ("" if self.cfg.train.spike == "rewind" else " (train.spike=warn: training on)"))
        self._log({"step": step, "spike": why, "spike_loss": loss, "spike_grad_norm": norm})
        if self.cfg.train.spike == "rewind":  # (kept out of the window until the step's end acts on it)
            self.spike = (step, why)

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Checkpoint the position (step `step`), unless inside a non-finite streak or before a rewind."""
        began = time.perf_counter()  # the step loop is blocked from here: what the save's line reports
        self.read_status()  # the skip counters and streak of every step so far, before deciding and saving
        if self.state.skip_streak:
            # Never save inside a non-finite streak: a resume would start from the diverging state with its streak
            # hidden. The latest complete checkpoint stays the one to resume from.
            latest = latest_checkpoint(self.run_dir)
            return self.say(f"warning: not saving a checkpoint at step {step}: {self.state.skip_streak} non-finite "
                            f"step(s) in a row; the latest checkpoint {latest if latest is not None else '(none)'} "
                            f"predates the streak")
        if self.spike is not None:  # the state holds a spike about to be rewound: not worth keeping
            return self.say(f"not saving a checkpoint at step {step}: the loss spike of step {self.spike[0]} is "
                            f"being rewound")
        ckpt = self.checkpointer
        path, position = self._write(step)
        self.copies.take(step, self.optimizer, position)
        self._last_saved = step
        self.say(f"{'started' if ckpt.async_save else 'saved'} checkpoint {path} (step loop blocked "
                 f"{time.perf_counter() - began:.3f}s)")

    def _write(self, step: int):
        """Checkpoint `step` of the model, optimizer and position as they are now: (its path, the position)."""
        position = self.position()
        return self.checkpointer.save(step, self.model, self.optimizer, position,
                                      self.log.wandb_id if self.log is not None else None), position

    def _checkpoint_after_step(self) -> None:
        if self.checkpointer is None:
            return
        self.checkpointer.poll()
        interval = self.cfg.checkpoint.interval
        if interval and self.state.step % interval == 0:
            self.save(self.state.step)

    def _checkpoint_at_end(self) -> None:
        if self.checkpointer is None:
            return
        # (A finished run started again resumes at its last step: its final checkpoint exists already.)
        step = self.state.step
        if (self.cfg.checkpoint.interval and self._last_saved != step
                and not is_complete(checkpoint_dir(self.run_dir, step))):
            self.save(step)
        self.checkpointer.wait()

    def _restore(self, step: int) -> str:
        """Model, optimizer and position of checkpoint `step` (host memory when a copy is there, else disk);
        returns where they came from."""
        # The steps after it are trained again: what this rank recorded of them belongs to the pass abandoned.
        self.local_stats = {k: v for k, v in self.local_stats.items() if k <= step}
        segments = self.state.data_segments
        if step in self.copies.steps():
            self.state, where = TrainState.of(self.copies.restore(step, self.optimizer)), "host memory"
        else:
            saved, _ = self.checkpointer.load(checkpoint_dir(self.run_dir, step), self.model, self.optimizer,
                                              self.position())
            self.state, where = TrainState.of(saved), "disk"
        self.state.data_segments = self.state.rewound_segments(segments)
        return where

    def _forget_after(self, target: int) -> None:
        """Checkpoints after `target` hold steps that are being trained again: removed (a resume must not find one)."""
        self.copies.drop_after(target)
        if self.rank == 0:
            for p in list_checkpoints(self.run_dir):
                if step_of(p) > target:
                    remove_step_dir(p)
        dist.barrier()

    # -- a loss spike: back to a checkpoint, its batches skipped (train.spike=rewind) ---------------------------
    def _rewind(self) -> None:
        """Act on the spike found (collective: every rank found it). With spike.rerun, first replay up to it: when
        the replay differs, a fault made the spike and training goes on from it, nothing skipped."""
        self.read_status()
        self.checkpointer.wait()  # an async save in flight completes before checkpoints are chosen or removed
        (step, why), self.spike = self.spike, None
        cfg, start = self.cfg.spike, time.perf_counter()
        targets = sorted({step_of(p) for p in list_checkpoints(self.run_dir)} | set(self.copies.steps()))
        windows = list(self.state.skip_windows)  # the batches of the steps up to the spike were picked with these
        plan = plan_rewind(self.cfg, step, why, self.state.rewinds, windows, targets)
        if plan is None:
            return self.say(f"warning: no checkpoint before step {step} to rewind to; training on")
        target = plan.target
        if cfg.rerun != "off":
            fault = self._rerun(target, step)
            if fault is not None:  # the replayed steps are sound: go on from the spiking step, nothing skipped
                self.state.rewinds += 1
                self._log({"step": step, "fault": fault, "rerun_from": target, "reason": why,
                           "rewind_seconds": time.perf_counter() - start})
                self.say(f"step {step}: rerun from step {target} differs: a fault, not the data ({fault}); training "
                         f"on from step {step} without skipping ({self.state.rewinds} of {cfg.max_rewinds} rewinds)")
                return self._forget_after(target)
        rewinds = self.state.rewinds + 1
        source = self._restore(target)
        s = self.state
        s.skip_windows, s.rewinds = merge_windows(windows + plan.skip), rewinds
        if cfg.lr_steps:
            s.lr_scale_until = max(s.lr_scale_until, target + cfg.lr_steps)
        self._forget_after(target)
        if self.rank == 0:
            write_skipped(self.run_dir, s.skip_windows, s.rewinds)
        if target not in [step_of(p) for p in list_checkpoints(self.run_dir)]:  # only in host memory: save it
            self._write(target)
        seconds = time.perf_counter() - start
        samples = sum(b - a + 1 for a, b in plan.skip) * self.cfg.train.global_batch_size
        self._log({"step": step, "rewind": rewinds, "rewind_to": target, "skipped_batches": windows_text(plan.skip),
                   "samples_skipped": samples, "reason": why, "rewind_source": source, "rewind_seconds": seconds})
        self.say(f"rewind {rewinds}/{cfg.max_rewinds}: back to step {target} ({source}, {seconds:.2f}s), batches "
                 f"{windows_text(plan.skip)} ({samples:,} samples) skipped"
                 + (f", learning rate x {cfg.lr_scale} until step {s.lr_scale_until}" if cfg.lr_steps else ""))

    def _rerun(self, target: int, step: int) -> str | None:
        """Replay steps target+1 .. step from checkpoint `target` (with spike.rerun=rotate, the spiking step with each
        data-parallel rank on its neighbour's batch); what differs from the first pass (rerun_verdict), or None."""
        original = {k: self.local_stats.get(k) for k in range(target + 1, step + 1)}
        self._restore(target)
        rotate = self.cfg.spike.rerun == "rotate" and self.dp_size > 1
        self.replaying = True
        try:
            while self.state.step < step:
                self.advance(self.state.step, rotate=rotate and self.state.step + 1 == step)
                self.read_status()
        finally:
            self.replaying = False
        mine = {k: (original[k], self.local_stats.get(k)) for k in original}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (self.dp_rank, mine))
        exact = self.device.type == "cpu" or self.cfg.train.deterministic
        return rerun_verdict(everyone, target + 1, step, rotate, self.dp_size, exact)

    # -- evaluations, logged -------------------------------------------------------------------------------------
    def _validate(self) -> None:
        """Log the validation loss (not when a stop request cut it short)."""
        val = self.evaluator.validation()
        if val is None:
            return self.say(f"validation at step {self.state.step} stopped by a stop request; not logged")
        self._log({"step": self.state.step, **val, "val_ppl": math.exp(min(val["val_loss"], 50.0))})

    def _eval_tasks(self) -> None:
        """Score every downstream task and log one row; a stop request ends it between tasks."""
        step, results = self.state.step, self.evaluator.run_tasks()
        if results is None:
            return self.say(f"task evaluation at step {step} stopped by a stop request; not logged")
        self._log(metrics_row(step, results))
        self.say(f"eval step {step} | " + " | ".join(summary(n, m) for n, m in results.items()))

    # -- the loop ---------------------------------------------------------------------------------------------
    def _start_lines(self, unigram: float) -> None:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        self.say(
            f"model {cfg.model.name}: {count_params(self.model) / 1e6:.2f}M parameters | device {self.device} "
            + (f"x {torch.get_num_threads()} thread(s) " if self.device.type == "cpu" else "")
            + f"({cfg.train.precision}) | mesh {dict(zip(self.mesh.mesh_dim_names, self.mesh.shape))}\n"
            f"data {self.data.description}: {self.data.samples_line(t.steps * t.global_batch_size, t.seq_len + 1)}, "
            f"split {cfg.data.split}, tokenizer {cfg.data.tokenizer} "
            f"({self.tokenizer.vocab_size} tokens; model vocab {cfg.model.vocab_size})\n"
            f"batch {t.global_batch_size} x {t.seq_len} = {tokens_per_step:,} tokens/step, "
            f"{self.run.microbatches} microbatch(es) of {t.micro_batch_size} per rank"
            + (f" | unigram baseline {unigram:.3f} nats/token" if math.isfinite(unigram) else ""))
        if self.run.layout_choice:
            self.say(self.run.layout_choice)
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        self.say(f"{len(hosts)} rank(s) on {len(set(hosts))} host(s): "
                 + ", ".join(f"{h} x{hosts.count(h)}" for h in dict.fromkeys(hosts)))

    def fit(self, started: float | None = None) -> TrainResult:
        """Train to train.steps (or a stop). started: when the launch began (time.time()), for the goodput record's
        startup (default: now)."""
        cfg, t, s = self.cfg, self.cfg.train, self.state
        if self.log is None:
            self.open_log(enabled=self.rank == 0)
        result = TrainResult(unigram_loss=self.data.unigram_loss)
        started = time.time() if started is None else started
        g = self.goodput = Goodput.begin(self.run_dir if self._keeps_goodput else None, started, s.step)
        for note in g.notes:
            self.say(note)
        self._start_lines(result.unigram_loss)
        tokens_per_step = t.global_batch_size * t.seq_len
        g.add("startup", time.time() - started)
        start = time.perf_counter()
        if t.eval_interval and s.step == 0 and t.steps > 0:  # (a seed-checkpoint start skips it)
            self._validate()
        if self.evaluator.tasks and s.step == 0 and t.steps > 0:
            self._eval_tasks()
        g.add("evaluation", time.perf_counter() - start)
        last_time, last_step = time.perf_counter(), s.step
        first_step = s.step + 1
        profile_range, profiler = cfg.profile.range, None
        while self.state.step < t.steps and not self.stop_voted:  # (a stop during the first validation: no step)
            step = self.state.step
            if profile_range and step + 1 == profile_range[0]:
                profiler = StepProfiler(cfg.profile, self.device, self.run_dir / "profile", self.rank)
            began, waited = time.perf_counter(), self.data_wait_total
            loss, grad_norm, lr = self.advance(step)
            step += 1
            done = step == t.steps
            log_now = step % cfg.logging.interval == 0 or done
            # The previous step's status is read while this one runs; all of it before a log row or at the end.
            self.read_status(keep_last=not log_now)
            stop = self.stop_voted
            if step == first_step and not log_now:
                # The first step of this start is slow (allocations, kernel selection, compile): say it ended.
                self.say(f"step {step}: first step done in {time.perf_counter() - last_time:.1f}s (loss "
                         f"{float(self._dp_sum(loss.clone())):.4f}); next lines every {cfg.logging.interval} steps")
            if step == first_step and t.compile:
                self.say(compile_summary())
            if profiler is not None and step == profile_range[1]:
                self.say(profiler.stop(profile_range))
                profiler = None
            waited = self.data_wait_total - waited
            if log_now or stop:
                loss_value = float(self._dp_sum(loss))  # the one host sync of the interval
                now = time.perf_counter()
                g.stepped(step, now - began - waited)
                g.add("data_wait", waited)
                result.losses[step] = loss_value
                self._log({**self._metrics(loss_value, lr, float(grad_norm), now - last_time, step - last_step,
                                           tokens_per_step), **g.row()})
                g.stepped(step, time.perf_counter() - now)  # (the row's own writing: part of the step's time)
                self._save_goodput()
                last_time, last_step = now, step
            else:
                g.stepped(step, time.perf_counter() - began - waited)
                g.add("data_wait", waited)
            if t.eval_interval and (step % t.eval_interval == 0 or done):
                began = time.perf_counter()
                self._validate()
                last_time = time.perf_counter()  # validation time is not training throughput
                g.add("evaluation", last_time - began)
                stop = stop or (self.stop_voted and not done)  # a signal during validation
            every = t.eval_tasks_interval
            if self.evaluator.tasks and (done or every and step % every == 0) and not self.stop_voted:
                began = time.perf_counter()
                self._eval_tasks()
                last_time = time.perf_counter()
                g.add("evaluation", last_time - began)
                stop = stop or (self.stop_voted and not done)
            began = time.perf_counter()
            self._checkpoint_after_step()
            g.add("checkpoint_stall", time.perf_counter() - began)
            if self._last_saved == step:
                self._save_goodput()
            if self.spike is not None and self.checkpointer is None:
                self.spike = None  # (a trainer without checkpoints to go back to: the warning was all)
            if self.spike is not None:
                began = time.perf_counter()
                self._rewind()  # back to a checkpoint (or on from a rerun), the spike's batches skipped
                last_time, last_step = time.perf_counter(), self.state.step
                g.rewound(self.state.step, last_time - began)
                self._save_goodput()
                continue
            if stop:
                result.preempted = True
                self.say(f"stop requested: leaving after step {step}")
                break
        self.read_status()
        result.preempted |= self.state.step < t.steps  # (stopped during the first validation: no break above)
        result.wall_time = time.perf_counter() - start
        began = time.perf_counter()
        if t.sample_tokens and not result.preempted and self.state.step > 0:  # no sample of an untrained model
            result.sample = self.evaluator.sample(t.sample_prompt, t.sample_tokens, t.sample_temperature)
            self.say(f"sample (temperature {t.sample_temperature}):\n{result.sample}")
        g.add("evaluation", time.perf_counter() - began)
        began = time.perf_counter()
        self._checkpoint_at_end()
        g.add("checkpoint_stall", time.perf_counter() - began)
        self._save_goodput()
        self.say(f"done: {self.state.step} steps in {result.wall_time:.1f}s")
        self.close()
        return result

    @property
    def _keeps_goodput(self) -> bool:
        """Rank 0 of a run that owns its run dir (it checkpoints) records the time accounting there."""
        return self.rank == 0 and self.checkpointer is not None

    def _save_goodput(self) -> None:
        if self._keeps_goodput and self.goodput is not None:
            self.goodput.save(self.run_dir, [step_of(p) for p in list_checkpoints(self.run_dir)])

    def close(self) -> None:
        """Closes the metrics log (once opened) and the data; fit() calls it on its way out, the session after an
        error; a second call does nothing."""
        if self.log is not None:
            self.log.close()
        self.data.close()

    def _metrics(self, loss: float, lr: float, grad_norm: float, elapsed: float, steps: int,
                 tokens_per_step: int) -> dict:
        """The row of a logging step; see docs/metrics.md for every field."""
        world, step = dist.get_world_size(), self.state.step
        step_time = elapsed / steps
        # Straggler view: the slowest and fastest rank's mean step time over the interval.
        spread = torch.tensor([step_time, -step_time], dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        staged, flops_per_token = {}, self.flops_per_token
        if self.run.stages is not None:  # stage, samples per source, tokens; the last batch's sequence length
            staged = self.data.train.dataset.trained_before(self.state.batch_for(step - 1) + 1,
                                                            self.state.skip_windows)
            tokens_per_step = self.cfg.train.global_batch_size * staged["seq_len"]
            flops_per_token = flops_per_token_of(self.cfg.model, staged["seq_len"])
        tps = steps * tokens_per_step / elapsed
        per_device = tps / world
        tflops = flops_per_token * per_device / 1e12
        row = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
               "tokens_per_sec_per_device": per_device, "tflops_per_device": tflops, "step_time": step_time,
               "step_time_max": float(spread[0]), "step_time_min": -float(spread[1]),
               "data_time": min(1.0, self.take_data_wait() / elapsed), "consumed_tokens": step * tokens_per_step,
               "skipped_steps": self.state.skipped, "batch_crc32": self.batch_crc32, **staged}
        if self.exact is not None:
            row["exact_replays"] = self.exact_replays
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
        return row
