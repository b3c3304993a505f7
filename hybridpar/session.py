"""Start-up, written once, and what a training process owns for its lifetime.

start_trainer(cfg): hybridpar.resolve.begin (world, device, process group, the resolved run), the mesh and the
Trainer (its data and model). A training run goes through a Session: start() wires the checkpointer, the host
copies a spike rewind reads and the resume from a checkpoint; open_run_dir() is the first write into the run dir,
once every input is checked. The Session restores on exit what it changed for the process: the signal handlers,
the run dir's lock, the process group it started, and watches the torchrun agent while it lasts.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.checkpoint.dcp import Checkpointer
from hybridpar.checkpoint.recovery import SKIPPED_FILE, read_skipped
from hybridpar.config import Config
from hybridpar.data.gpt_data import release_index_readers
from hybridpar.errors import UserError
from hybridpar.parallel.distributed import agent_gone, init_mesh, shutdown, watch_agent, world_from_env
from hybridpar.resolve import Run, begin
from hybridpar.trainer import Trainer
from hybridpar.training.microbatch import StopMidStep
from hybridpar.training.state import TrainResult

EXIT_ABORTED = 76  # a second signal arrived while the preemption save was running
EXIT_ORPHANED = 77  # the torchrun agent that started this worker died: stopped at once, nothing more written
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
PREEMPTED = "PREEMPTED"  # <run.dir>/PREEMPTED: written when the run saved and stopped on a signal
EVERY_RANK_ERROR_WAIT_S = 20  # the longest a rank other than 0 waits for rank 0 to say an error every rank has


class StoppedWithoutCheckpoint(Exception):
    """A signal stopped a run that saves no checkpoints: nothing to resume from. Its exit code is the shell's for
    "ended by a signal" (128 + its number), so that a requeue wrapper waiting for 75 does not restart from step 0."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def start_trainer(cfg: Config, own_run_dir: bool = False, checkpointing: bool = False) -> Trainer:
    """begin(), the mesh of the run's degrees, the Trainer (its data and model). The model is left uninitialised
    when the run resumes from a checkpoint (run.load_from): each rank then reads its shards into it. checkpointing:
    the trainer saves checkpoints and keeps host copies for spike rewinds (a training run's)."""
    run = begin(cfg, own_run_dir)
    try:
        checkpointer, keep = None, 0
        if checkpointing:
            checkpointer = Checkpointer(run.run_dir, run.cfg, run.tokenizer, run.device)
            keep = run.cfg.spike.keep_in_memory if run.cfg.train.spike == "rewind" else 0
        return Trainer(run, init_mesh(run.layout.degrees, run.device), init_weights=run.load_from is None,
                       checkpointer=checkpointer, keep_in_memory=keep)
    except BaseException:
        if run.lock is not None:
            run.lock.release()
        release_index_readers()  # the data a failed start-up opened: megatron-core's readers keep their .idx open
        raise


def _keep_metrics_until(path: Path, step: int) -> None:
    """A resumed run re-logs the steps after its checkpoint: drop the killed run's rows past it (and a line torn by
    the kill). Written to a temporary file and renamed, so a crash here loses nothing."""
    if not path.exists():
        return
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        at = row.get("step", 0) if isinstance(row, dict) else None
        if type(at) is int and at <= step:  # (a row whose step is no step is not the run's: dropped)
            rows.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)


class Session:
    """One training process's run: `with Session() as s: trainer = s.start(cfg)`. On exit (also after an error) the
    trainer's data and log are closed, the run dir's lock released, the process group shut down (when the session
    started it), the torchrun agent no longer watched and the signal handlers put back as they were; an error every
    rank raised is said once (by rank 0)."""

    def __init__(self):
        self.run: Run | None = None
        self.trainer: Trainer | None = None

    def __enter__(self) -> "Session":
        self._handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        self._had_group = dist.is_initialized()  # (a caller's own process group is the caller's to destroy)
        self._watching = threading.Event()
        self._agent = watch_agent(self._orphaned, stop=self._watching)
        return self

    def _orphaned(self, why: str) -> None:
        print(f"rank {world_from_env().rank}: {why}: exiting at once, writing nothing more (the latest complete "
              f"checkpoint stands; start the job again to resume)", file=sys.stderr, flush=True)
        if self.run is not None and self.run.lock is not None:
            self.run.lock.release()  # (rank 0) so that the restarted run can take the run dir
        os._exit(EXIT_ORPHANED)

    def __exit__(self, kind, error, _tb) -> bool:
        try:
            if isinstance(error, Exception):
                # A sibling worker that saw the agent go exits first, and this rank's next collective fails
                # (connection reset) before its own watcher wakes: the same event, said the same way.
                why = agent_gone(self._agent)
                if why is not None:
                    self._orphaned(why)
                if isinstance(error, UserError) and getattr(error, "on_every_rank", False) and dist.is_initialized():
                    say_once(error)
            elif error is None and self.trainer is not None and dist.get_world_size() > 1:
                # Every rank done with every collective before any rank tears its process group down. On the
                # success path only: after an error on one rank, a barrier would wait for the collective timeout.
                dist.barrier()
        finally:
            if self.trainer is not None:
                self.trainer.close()
            if self.run is not None and self.run.lock is not None:
                self.run.lock.release()
            self.trainer = None  # the model (and the process groups its DTensors hold) go before the groups do
            if not self._had_group:
                shutdown()
            self._watching.set()
            for sig, handler in self._handlers.items():
                signal.signal(sig, handler)
        return False

    def start(self, cfg: Config) -> tuple[Trainer, list[str], float]:
        """The run's trainer, resumed from its checkpoint when there is one; returns it with the data settings that
        changed on resume and the seconds the checkpoint took to read."""
        self.trainer = start_trainer(cfg, own_run_dir=True, checkpointing=True)
        self.run, trainer = self.trainer.run, self.trainer
        load_from, weights_only = self.run.load_from, self.run.cfg.checkpoint.load_weights_only
        changes, seconds = [], 0.0
        if load_from is not None:
            t0 = time.perf_counter()
            skipped = ([], 0) if weights_only else read_skipped(load_from.parent.parent)  # rewinds since then
            changes = trainer.resume(load_from, weights_only, skipped)
            seconds = time.perf_counter() - t0
        return trainer, changes, seconds

    def train(self, cfg: Config, started: float | None = None) -> TrainResult:
        """A training run in this process, in its order: the trainer, resumed; nothing more when it is finished
        already; the signal handlers; the run dir's first writes; fit() (started: when the launch began, for the
        goodput record). A stop with nothing saved is StoppedWithoutCheckpoint."""
        trainer, data_changes, read_seconds = self.start(cfg)
        if self.finished():
            return TrainResult()
        # Before the run writes anything: a signal from then on (a test, or SLURM, sees metrics.jsonl appear) is a
        # preemption, not the default kill.
        self.catch_signals()
        self.open_run_dir(data_changes, read_seconds)
        saving = trainer.cfg.checkpoint.interval > 0
        try:
            result = trainer.fit(started=started)
        except StopMidStep as e:
            raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop.signum).name} in step "
                                           f"{trainer.state.step + 1}, {e}; nothing saved (checkpoint.interval 0), "
                                           f"so the run cannot be resumed", trainer.stop.signum) from None
        if result.preempted and not saving:
            raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop.signum).name} after step "
                                           f"{trainer.state.step}; nothing saved (checkpoint.interval 0), so the run "
                                           f"cannot be resumed", trainer.stop.signum)
        if result.preempted:
            self.mark_preempted()
        return result

    def catch_signals(self) -> None:
        """SIGTERM / SIGUSR1 (SLURM's warning before preemption or the time limit) / SIGINT (Ctrl-C): with
        checkpointing, finish the step, save, exit preempted; without, stop after the current microbatch. A second
        signal aborts at once (the previous checkpoint stays)."""
        trainer, saving = self.trainer, self.trainer.cfg.checkpoint.interval > 0

        def handler(signum, _frame):
            if trainer.stop.requested:
                print(f"signal {signal.Signals(signum).name} again: aborting", file=sys.stderr, flush=True)
                os._exit(EXIT_ABORTED)
            print(f"signal {signal.Signals(signum).name}: stopping " + ("after this step, with a checkpoint" if saving
                  else "after the current microbatch (no checkpoint: checkpoint.interval 0)"), file=sys.stderr,
                  flush=True)
            trainer.request_stop(signum)

        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)

    def open_run_dir(self, changes: list[str], read_seconds: float) -> None:
        """The run's first writes (rank 0), with every input checked: its config.yaml and tokenizer, the metrics of a
        resumed run cut back to its checkpoint (or a fresh run's removed), the log opened, what the start found."""
        run, trainer, cfg = self.run, self.trainer, self.run.cfg
        run_dir, load_from, step = run.run_dir, run.load_from, trainer.state.step
        if run.world.rank != 0:
            return
        run.lock.keep_dirs()
        resumed = step > 0
        restarted = not resumed and (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite
        if resumed:
            _keep_metrics_until(run_dir / "metrics.jsonl", step)
        else:
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            (run_dir / SKIPPED_FILE).unlink(missing_ok=True)
        from hybridpar.config.cli import dump_yaml, to_dict

        (run_dir / "config.yaml").write_text(dump_yaml(cfg))
        run.tokenizer.save(run_dir)
        trainer.open_log(enabled=True, config_dict=to_dict(cfg))
        say = trainer.say
        say(f"run dir {run_dir}")
        if restarted and load_from is None:
            say(f"note: {run_dir} holds a run stopped before its first checkpoint: starting it again from step 0 "
                f"(its metrics.jsonl replaced)")
        if load_from is not None:
            what = "weights of" if cfg.checkpoint.load_weights_only else "resuming from"
            say(f"{what} {load_from} (step {step}, {trainer.state.consumed_samples:,} samples; read in "
                f"{read_seconds:.2f}s)")
            was, now = run.run_state.get("cpu_threads"), torch.get_num_threads()
            if not cfg.checkpoint.load_weights_only and run.device.type == "cpu" and was and was != now:
                say(f"note: {load_from.name} was written by a CPU run with {was} intra-op threads and this one has "
                    f"{now}: the curve continues to rounding, not bitwise (OMP_NUM_THREADS={was} resumes it exactly)")
            for note in exact_resume_notes(load_from, cfg):
                say(note)
        if changes:
            say("warning: data settings changed on resume (checkpoint.allow_data_change): " + "; ".join(changes))
            trainer.log.log({"step": step, "data_change": "; ".join(changes)})
        (run_dir / PREEMPTED).unlink(missing_ok=True)
        if os.environ.get("SLURM_JOB_ID") and cfg.checkpoint.interval == 0:
            say(f"warning: SLURM job {os.environ['SLURM_JOB_ID']} runs with checkpoint.interval 0: a preemption, time "
                f"limit or requeue loses the run; set --checkpoint.interval N")

    def finished(self) -> bool:
        """Whether the run resumed at or past train.steps: said (rank 0), nothing to train and nothing written."""
        run, step = self.run, self.trainer.state.step
        cfg = run.cfg
        if run.load_from is None or cfg.checkpoint.load_weights_only or step < cfg.train.steps:
            return False
        if run.world.rank == 0:  # e.g. the run's own config.yaml passed back
            print(f"{run.run_dir}: the run is already at step {step} ({run.load_from.name}), at or past train.steps="
                  f"{cfg.train.steps}: nothing to train, nothing written; raise --train.steps to continue it",
                  flush=True)
        return True

    def mark_preempted(self) -> None:
        """<run.dir>/PREEMPTED (rank 0), for job scripts: torchrun turns a worker's exit status into its own."""
        if self.run.world.rank == 0:
            (self.run.run_dir / PREEMPTED).write_text(f"step {self.trainer.state.step}\n")


def say_once(e: UserError) -> None:
    """An error every rank raised, said by rank 0 alone while the process group is up; the other ranks wait (on the
    group's store, whatever the backend) until it is said, so none exits first. A launcher stops every rank when the
    first one fails (torchrun, srun --kill-on-bad-exit): had rank 1 exited first, rank 0 could be stopped before it
    said the error."""
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 0:
        print(f"error: {e}", file=sys.stderr, flush=True)
        store.set("hybridpar/error_said", "1")
    elif dist.get_world_size() > 1:
        try:
            store.wait(["hybridpar/error_said"], datetime.timedelta(seconds=EVERY_RANK_ERROR_WAIT_S))
        except Exception:  # rank 0 did not get here (the launcher stops this rank, or the bound ends the wait)
            pass
    e.said = True


def exact_resume_notes(load_from: Path, cfg: Config) -> list[str]:
    """parallel.exact_reduction is bitwise across data-parallel degrees at a fixed tp and microbatch: a resume that
    changed either continues the curve to rounding only, said here (nothing is refused: the run is still sound)."""
    if not cfg.parallel.exact_reduction or cfg.checkpoint.load_weights_only:
        return []
    from hybridpar.checkpoint.resume_checks import read_checkpoint_config

    saved = read_checkpoint_config(load_from) or {}
    was_exact = saved.get("parallel", {}).get("exact_reduction")
    fields = (("parallel", "tp", cfg.parallel.tp), ("train", "micro_batch_size", cfg.train.micro_batch_size))
    changed = [f"{a}.{b} {saved[a][b]} -> {now}" for a, b, now in fields
               if was_exact and isinstance(saved.get(a), dict) and saved[a].get(b) not in (None, now)]
    if was_exact is False:
        return [f"note: {load_from.name} was trained without parallel.exact_reduction: the curve from here is exact "
                f"across data-parallel degrees, the steps before it were not"]
    if not changed:
        return []
    return [f"note: {load_from.name} was trained with parallel.exact_reduction at another {', '.join(changed)}: the "
            f"mode is bitwise across data-parallel degrees at a fixed tp and micro-batch size, so the curve continues "
            f"to rounding, not bitwise (resume with the checkpoint's values to keep it exact)"]
