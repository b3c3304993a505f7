"""The trainer: one loop for every layout, on a resolved Run (hybridpar.resolve) and the mesh of its degrees. It
builds its data and model and owns its parts: the loop's record (TrainState: what a checkpoint keeps, a resume or a
rewind replaces), the step statuses, the gradient reduction, the evaluator and, in a training run, the checkpointer
and the recovery from spikes. They are given what they need and return decisions; the loop acts on them, and writes
through them: checkpoints (removed after a rewind), skipped_batches.json, goodput.json, the metrics log.

Host syncs: none inside a step with the fused AdamW (the default on GPUs): a non-finite gradient norm skips the
update on the device (the optimizer's found_inf, as with a gradient scaler), and the norm with the ranks' stop votes
is read one step late, while the next step runs (or at once before a log row or a checkpoint). The unfused optimizer
(the default on CPU) reads them in the step, since it can only be skipped from the host. Losses stay on the device
until a log step.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.checkpoint.layout import list_checkpoints, step_of
from hybridpar.checkpoint.recovery import Recovery, resumed_state
from hybridpar.data.dataset import build_training_data
from hybridpar.data.record import segment
from hybridpar.inference.in_training import Evaluator
from hybridpar.inference.tasks import load_tasks
from hybridpar.metrics import MetricsLogger, StepProfiler, compile_summary, start_lines
from hybridpar.parallel import start_notes
from hybridpar.parallel.distributed import dp_rank_size, dp_sum, set_numerics
from hybridpar.parallel.experts import scale_moe_grads
from hybridpar.parallel.startup import build_parallel_model
from hybridpar.planning.flops import Throughput
from hybridpar.resolve import Run
from hybridpar.training.goodput import Clock, Goodput
from hybridpar.training.lr_schedule import lr_at
from hybridpar.training.microbatch import StepNumerics, step_gradients
from hybridpar.training.optim import build_optimizer, clip_grad_norm, optimizer_step, peak_lr_ratio
from hybridpar.training.reduction import build_reduction
from hybridpar.training.spikes import refuse_skips
from hybridpar.training.state import Stop, TrainResult, TrainState
from hybridpar.training.step_status import StatusQueue, StepReading, TrainingDiverged


class Trainer:
    def __init__(self, run: Run, mesh: DeviceMesh, init_weights: bool = True, checkpointer=None,
                 keep_in_memory: int = 0):
        """The loop of a resolved run on its mesh; init_weights=False leaves the shards for a checkpoint to fill.
        Without a checkpointer nothing is saved and a spike is only reported; keep_in_memory: host copies kept."""
        cfg, device = run.cfg, run.device
        self.run, self.mesh = run, mesh
        set_numerics(cfg.train.deterministic, cfg.train.tf32)
        if cfg.train.compile and self.rank == 0:
            torch._logging.set_logs(recompiles=True)  # a recompilation says which guard failed, when it happens
        self.log: MetricsLogger | None = None  # opened by fit() (or the session)
        self.expert_counts: torch.Tensor | None = None  # a mixture of experts' last step: (blocks, E) tokens
        for note in start_notes(cfg, device):
            self.say(note)
        t0 = time.perf_counter()
        dp_rank, dp_size = dp_rank_size(mesh)
        self.dp_sum = dp_sum(mesh)
        self.data = build_training_data(cfg, run.tokenizer, run.stages, dp_rank, dp_size, device.type == "cuda")
        self.say(f"start-up: data ready in {time.perf_counter() - t0:.2f}s (indexes, sample order)")
        tasks = load_tasks(cfg.train.eval_tasks, cfg.data)  # read and checked now: a bad task file stops the start
        # Model: built and parallelised on the meta device; this rank materialises and initialises only its shards,
        # with values keyed by global position, so the initial model is bitwise the same for every layout.
        self.model = build_parallel_model(cfg, mesh, device, init=init_weights, report=self.say)
        ns_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32  # Muon's Newton-Schulz
        self.optimizer = build_optimizer(self.model, cfg.optim, ns_dtype, cfg.train.seed)
        self.numerics = StepNumerics.of(cfg, self.model, mesh["tp"].size(), device, mesh["cp"].size(),
                                        mesh["cp"].get_local_rank())
        self.reduction = build_reduction(cfg, self.model, mesh, dp_size * mesh["cp"].size())  # (FSDP's ranks)
        self.stop, self.clock = Stop(), Clock()
        self.evaluator = Evaluator(cfg, self.model, mesh, device, run.tokenizer, self.numerics, self.data, tasks,
                                   self.dp_sum, lambda: self.stop.poll(device))
        self.checkpointer = checkpointer
        self.recovery = Recovery(cfg, run.run_dir, checkpointer, keep_in_memory, dp_rank, dp_size,
                                 device.type == "cpu" or cfg.train.deterministic, self.say, self._log)
        self._last_saved = -1  # the step of the newest checkpoint this process saved
        # what this start reads (hybridpar.data.record), the first segment of its record
        self.state = TrainState(skip_windows=list(cfg.data.skip_windows),
                                data_segments=[segment(cfg, 0, self.data.prefixes)])
        self.status = StatusQueue()
        refuse_skips(cfg, 0, [], self.state.skip_windows, self.data.train.n_batches)
        self.goodput: Goodput | None = None  # fit()'s time accounting (hybridpar.training.goodput)
        self.profiler: StepProfiler | None = None  # fit()'s (profile.steps)
        self.rates = Throughput(cfg, device)

    # what the run fixes, read from it
    cfg = property(lambda self: self.run.cfg)
    device = property(lambda self: self.run.device)
    run_dir = property(lambda self: self.run.run_dir)
    rank = property(lambda self: dist.get_rank())

    def open_log(self, enabled: bool, config_dict: dict | None = None) -> None:
        """Open the metrics logger into the run dir (fit() opens one, enabled on rank 0, when none is open)."""
        self.log = MetricsLogger(self.cfg, self.run_dir, enabled=enabled, config_dict=config_dict)

    def request_stop(self, signum: int) -> None:
        """Stop at the end of this step, or after this microbatch when nothing would be saved (a signal handler)."""
        self.stop.request(signum)

    # -- the loop's position: what a checkpoint keeps, what a resume and a rewind replace ------------------------
    def position(self, state: TrainState | None = None) -> dict:
        """The entries of a TrainState (default: the loop's), with a staged run's stage_origin ([batch, counts...]
        where the stages were last changed on resume)."""
        out = (self.state if state is None else state).state_dict()
        if self.run.stages is not None:
            out["stage_origin"] = torch.from_numpy(self.data.train.dataset.origin())
        return out

    def resume(self, path, weights_only: bool = False, skipped: tuple[list, int] = ([], 0)) -> list[str]:
        """Load checkpoint `path` (its weights only, with weights_only) and continue from its position: the skipped
        batches are the union of the checkpoint's, this run's data.skip_batches and `skipped` (the windows and rewind
        count the run dir recorded since that checkpoint). Returns the data settings that changed."""
        saved, changes = self.checkpointer.load(path, self.model, self.optimizer, self.position(), weights_only)
        if saved is not None:
            self.state, origin = resumed_state(self.cfg, path, saved, self.state.data_segments[-1], self.run.stages,
                                               self.data.train.n_batches, self.run_dir, skipped)
            if origin is not None:
                self.data.train.dataset.restart_at(*origin)
        return changes

    def say(self, message: str) -> None:
        """A console line from rank 0, through the metrics logger once fit() (or the session) has opened it."""
        if self.log is not None:
            self.log.print(message)
        elif self.rank == 0:
            print(message, flush=True)

    def _log(self, row: dict) -> None:
        if self.log is not None:
            self.log.log(row)

    # -- one optimizer step -----------------------------------------------------------------------------------
    def train_step(self, step: int, rotate: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Optimizer step step + 1 (`step` are done). Returns (loss share, grad norm, lr), the first two on the
        device. A non-finite gradient norm skips the optimizer update; the norm and the ranks' stop votes are read
        by read_status(). rotate: each data-parallel rank trains its neighbour's batch (a spike.rerun=rotate
        replay)."""
        cfg, n, red = self.cfg, self.numerics, self.reduction
        # Random numbers (dropout) come from (seed, step): a resumed run (and a replay) draws what the first did.
        seed = cfg.train.seed * 1_000_003 + step
        torch.manual_seed(seed)
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
        self.clock.waited(time.perf_counter() - t0)
        moe = self.cfg.model.n_experts > 0
        if moe:
            self.model.take_expert_counts()  # (what an abandoned attempt at this step counted)
        # without checkpointing nothing is saved at the step's end: a stop need not wait for it (minutes on CPU)
        loss, self.state.exact_bounds = step_gradients(
            self.model, microbatches, n, red, self.state.exact_bounds, seed, self.dp_sum, self.device,
            lambda: self.stop.requested and cfg.checkpoint.interval == 0)
        if moe:
            scale_moe_grads(self.model)  # (its FSDP units average over other meshes than the dense ones)
        local = self.recovery.local_numbers(loss, self.model)
        grad_norm = clip_grad_norm(self.model, cfg.train.grad_clip, red.grad_norm).reshape(()).float()
        # (norm, stop vote, global loss when spikes are tested): read by read_status(), now or one step late
        parts = [grad_norm, self.stop.vote(self.device)]
        if cfg.train.spike != "off":
            parts.append(self.dp_sum(loss.detach().clone().reshape(())).float())  # (exact mode: summed in float64)
        self.status.push(step + 1, torch.stack(parts), local)
        optimizer_step(self.optimizer, grad_norm, self.read_status)  # (unfused: the status read now)
        if moe:  # the step's tokens per expert over the whole batch (every rank's), then the bias update
            self.expert_counts = self.model.take_expert_counts()
            dist.all_reduce(self.expert_counts)
            if cfg.model.moe_bias_update_rate > 0:
                self.model.update_expert_bias(self.expert_counts, cfg.model.moe_bias_update_rate)
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
        self.recovery.note_local(r.step, r.local)
        finite = math.isfinite(r.grad_norm)
        if finite and r.loss is not None:
            s.spike_history = self.recovery.test(r.step, r.loss, r.grad_norm, s.spike_history)
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
        self.stop.voted = self.stop.voted or r.stop_voted
        return finite

    # -- checkpoints and rewinds -------------------------------------------------------------------------------
    def save(self, step: int) -> None:
        """Checkpoint the position (step `step`), unless inside a non-finite streak or before a rewind."""
        began = time.perf_counter()  # the step loop is blocked from here: what the save's line reports
        self.read_status()  # the skip counters and streak of every step so far, before deciding and saving
        refused = self.recovery.save_refused(self.state, step)
        if refused is not None:
            return self.say(refused)
        path, position = self._write(step)
        self.recovery.took(step, self.optimizer, position)
        self._last_saved = step
        self.say(f"{'started' if self.checkpointer.async_save else 'saved'} checkpoint {path} (step loop blocked "
                 f"{time.perf_counter() - began:.3f}s)")

    def _write(self, step: int, state: TrainState | None = None):
        """Checkpoint `step` of the model and optimizer as they are now, at `state` (default: the loop's): (its
        path, the position)."""
        position = self.position(state)
        return self.checkpointer.save(step, self.model, self.optimizer, position,
                                      self.log.wandb_id if self.log is not None else None), position

    def _replay(self, state: TrainState, step: int, rotate: bool) -> TrainState:
        """From `state` (restored), train to step `step` again (rotate: the last on the neighbour's batch)."""
        self.state = state
        while self.state.step < step:
            self.advance(self.state.step, rotate=rotate and self.state.step + 1 == step)
            self.read_status()
        return self.state

    def _rewind(self) -> bool:
        """The loss spike found, acted on (hybridpar.checkpoint.recovery): whether the loop's state was replaced."""
        if self.checkpointer is not None:
            self.read_status()
        state = self.recovery.act(self.state, self.model, self.optimizer, self.position, self._write, self._replay)
        if state is not None:
            self.state = state
        return state is not None

    # -- the loop ---------------------------------------------------------------------------------------------
    def fit(self, started: float | None = None, on_step: Callable[[int], None] | None = None) -> TrainResult:
        """Train to train.steps (or a stop). started: when the launch began (time.time()), for the goodput record's
        startup (default: now). on_step(steps done): called before each step and after the last (benchmarks)."""
        t = self.cfg.train
        if self.log is None:
            self.open_log(enabled=self.rank == 0)
        result = TrainResult(unigram_loss=self.data.unigram_loss)
        started = time.time() if started is None else started
        g = self.goodput = Goodput.begin(self.run_dir if self._keeps_goodput else None, started, self.state.step)
        self.profiler = StepProfiler(self.cfg.profile, self.device, self.run_dir / "profile", self.rank)
        for line in g.notes + start_lines(self.run, self.model, self.mesh, self.data, result.unigram_loss):
            self.say(line)
        g.add("startup", time.time() - started)
        start = time.perf_counter()
        with g.timed("evaluation"):
            if self.state.step == 0 and t.steps > 0:  # (a seed-checkpoint start skips them)
                if t.eval_interval:
                    self.evaluator.validate_at(self.state.step, self._log, self.say)
                if self.evaluator.tasks:
                    self.evaluator.tasks_at(self.state.step, self._log, self.say)
        self.clock.mark(self.state.step)
        first = self.state.step + 1
        while self.state.step < t.steps and not self.stop.voted:  # (a stop during the first validation: no step)
            if on_step is not None:
                on_step(self.state.step)
            if self._step(result, first):
                result.preempted = True
                self.say(f"stop requested: leaving after step {self.state.step}")
                break
        if on_step is not None:
            on_step(self.state.step)
        self.read_status()
        result.preempted |= self.state.step < t.steps  # (stopped during the first validation: no break above)
        result.wall_time = time.perf_counter() - start
        with g.timed("evaluation"):
            if t.sample_tokens and not result.preempted and self.state.step > 0:  # no sample of an untrained model
                result.sample = self.evaluator.sample(t.sample_prompt, t.sample_tokens, t.sample_temperature)
                self.say(f"sample (temperature {t.sample_temperature}):\n{result.sample}")
        with g.timed("checkpoint_stall"):
            self._checkpoint(end=True)
        self._save_goodput()
        self.say(f"done: {self.state.step} steps in {result.wall_time:.1f}s")
        self.close()
        return result

    def _step(self, result: TrainResult, first: int) -> bool:
        """One step of fit(), with its log row, evaluations, checkpoint and rewind: whether the loop stops after it."""
        cfg, t, g, clock = self.cfg, self.cfg.train, self.goodput, self.clock
        self.profiler.before(self.state.step + 1)
        began, waited = time.perf_counter(), clock.data_wait_total
        loss, grad_norm, lr = self.advance(self.state.step)
        step = self.state.step
        done = step == t.steps
        log_now = step % cfg.logging.interval == 0 or done
        self.read_status(keep_last=not log_now)  # the previous step's, read while this one runs; all before a row
        stop = self.stop.voted
        if step == first and not log_now:  # the first step of a start is slow (allocations, compile): say it ended
            self.say(f"step {step}: first step done in {time.perf_counter() - clock.since:.1f}s (loss "
                     f"{float(self.dp_sum(loss.clone())):.4f}); next lines every {cfg.logging.interval} steps")
        if step == first and t.compile:
            self.say(compile_summary())
        written = self.profiler.after(step)
        if written:
            self.say(written)
        waited = clock.data_wait_total - waited
        if log_now or stop:
            loss_value = float(self.dp_sum(loss))  # the one host sync of the interval
            now = time.perf_counter()
            g.step_took(step, now - began, waited)
            result.losses[step] = loss_value
            self._log({**self._metrics(loss_value, lr, float(grad_norm), now - clock.since, step - clock.since_step),
                       **g.row()})
            g.stepped(step, time.perf_counter() - now)  # (the row's own writing: part of the step's time)
            self._save_goodput()
            clock.since, clock.since_step = now, step
        else:
            g.step_took(step, time.perf_counter() - began, waited)
        every = t.eval_tasks_interval
        if t.eval_interval and (step % t.eval_interval == 0 or done):
            stop = self._evaluation(self.evaluator.validate_at, done) or stop
        if self.evaluator.tasks and (done or every and step % every == 0) and not self.stop.voted:
            stop = self._evaluation(self.evaluator.tasks_at, done) or stop
        with g.timed("checkpoint_stall"):
            self._checkpoint()
        if self._last_saved == step:
            self._save_goodput()
        if self.recovery.spike is not None:
            began = time.perf_counter()
            if self._rewind():  # back to a checkpoint (or on from a rerun), the spike's batches skipped
                g.rewound(self.state.step, clock.mark(self.state.step) - began)
                self._save_goodput()
                return False
        return stop

    def _evaluation(self, evaluate, done: bool) -> bool:
        """An evaluation inside the loop, timed apart from training; whether a signal during it stops the loop."""
        with self.goodput.timed("evaluation"):
            evaluate(self.state.step, self._log, self.say)
        self.clock.mark()  # evaluation time is not training throughput
        return self.stop.voted and not done

    def _metrics(self, loss: float, lr: float, grad_norm: float, elapsed: float, steps: int) -> dict:
        """The row of a logging step; see docs/metrics.md for every field."""
        step, seq_len, staged = self.state.step, self.cfg.train.seq_len, {}
        if self.run.stages is not None:  # stage, samples per source, tokens; the last batch's sequence length
            staged = self.data.train.dataset.trained_before(self.state.batch_for(step - 1) + 1,
                                                            self.state.skip_windows)
            seq_len = staged["seq_len"]
        return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                **self.rates.row(step, elapsed, steps, seq_len, self.clock.take_data_wait()),
                "skipped_steps": self.state.skipped,
                "batch_crc32": self.data.train.crc32.get(self.state.batch_for(step - 1)), **staged,
                **self.reduction.row()}

    def _checkpoint(self, end: bool = False) -> None:
        """The checkpoint due after a step or at the end (the checkpointer decides), saved; at the end, waited for."""
        if self.checkpointer is None:
            return
        self.checkpointer.poll()
        if self.checkpointer.due(self.state.step, self._last_saved, end):
            self.save(self.state.step)
        if end:
            self.checkpointer.wait()

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
