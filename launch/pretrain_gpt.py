"""Pretrain a GPT with hybridpar.

    python launch/pretrain_gpt.py                                  # tiny model on the built-in corpus
    python launch/pretrain_gpt.py --config configs/gpt2-124m.yaml --train.steps 1000
    python launch/pretrain_gpt.py --help                           # every field, its docstring and default
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.checkpoint.dcp import CheckpointHook, Checkpointer
from hybridpar.config import Config, merge_windows
from hybridpar.config.cli import dump_yaml, help_text, load_config, to_dict
from hybridpar.errors import UserError
from hybridpar.parallel.distributed import agent_gone, shutdown, watch_agent, world_from_env
from hybridpar.trainer import Trainer, TrainResult, start_trainer
from hybridpar.training.step_status import TrainingDiverged
from hybridpar.checkpoint.rewind import SKIPPED_FILE, Rewinder, SpikeLimit, read_skipped
from hybridpar.training.spikes import HostCopies
from hybridpar.training.microbatch import StopMidStep


EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1/SIGINT after saving: requeue me (EX_TEMPFAIL)
EXIT_ABORTED = 76  # a second signal arrived while the preemption save was running
EXIT_ORPHANED = 77  # the torchrun agent that started this worker died: stopped at once, nothing more written
# Stopped by a signal with nothing saved (checkpoint.interval 0): 128 + the signal's number, the shell's convention
# for "ended by a signal", so that a requeue wrapper waiting for 75 does not restart the run from step 0.
PREEMPTED = "PREEMPTED"  # <run.dir>/PREEMPTED: written when the run saved and stopped on a signal


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
        if isinstance(row, dict) and row.get("step", 0) <= step:
            rows.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    tmp.replace(path)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _install_signal_handlers(trainer: Trainer) -> None:
    """SIGTERM / SIGUSR1 (SLURM's warning before preemption or the time limit) / SIGINT (Ctrl-C): with checkpointing,
    finish the step, save, exit EXIT_PREEMPTED; without, stop after the current microbatch and exit 128 + signal.
    A second signal aborts at once (the previous checkpoint stays)."""
    saving = trainer.cfg.checkpoint.interval > 0

    def handler(signum, _frame):
        if trainer.stop_requested:
            print(f"signal {signal.Signals(signum).name} again: aborting", file=sys.stderr, flush=True)
            os._exit(EXIT_ABORTED)
        print(f"signal {signal.Signals(signum).name}: stopping " + ("after this step, with a checkpoint" if saving else
              "after the current microbatch (no checkpoint: checkpoint.interval 0)"), file=sys.stderr, flush=True)
        trainer.request_stop(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


class StoppedWithoutCheckpoint(Exception):
    """A signal stopped a run that saves no checkpoints: nothing to resume from."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def main(cfg: Config, hooks=()) -> TrainResult:
    """Train with `cfg` on the processes the launcher started (one without a launcher); `hooks` are added to the
    trainer's (hybridpar.trainer.Hook: drills and extra logging)."""
    run = trainer = None
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # restored on the way out (a caller's own)

    def orphaned(why: str) -> None:
        print(f"rank {world_from_env().rank}: {why}: exiting at once, writing nothing more (the latest complete "
              f"checkpoint stands; start the job again to resume)", file=sys.stderr, flush=True)
        if run is not None and run.lock is not None:
            run.lock.release()  # (rank 0) so that the restarted run can take the run dir
        os._exit(EXIT_ORPHANED)

    agent = watch_agent(orphaned)
    try:
        # Resolve (every derivation and check; the run dir's lock taken), then mesh, data and model.
        trainer = start_trainer(cfg, own_run_dir=True)
        run = trainer.run
        cfg, run_dir, load_from, device, world = run.cfg, run.run_dir, run.load_from, run.device, run.world
        checkpointer = Checkpointer(run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
        rewinding = cfg.train.spike == "rewind"
        copies = HostCopies(cfg.spike.keep_in_memory if rewinding else 0)
        trainer.hooks.append(CheckpointHook(checkpointer, cfg.checkpoint.interval, copies))
        trainer.hooks.extend(hooks)
        if rewinding:
            trainer.rewinder = Rewinder(checkpointer, copies)
        data_changes, read_seconds = [], 0.0
        if load_from is not None:
            t0 = time.perf_counter()
            data_changes = checkpointer.load(trainer, load_from, weights_only=cfg.checkpoint.load_weights_only)
            read_seconds = time.perf_counter() - t0
            if not cfg.checkpoint.load_weights_only:  # rewinds of that run since its checkpoint was written
                windows, rewinds = read_skipped(load_from.parent.parent)
                trainer.skip_windows = merge_windows(trainer.skip_windows + windows)
                trainer.rewinds = max(trainer.rewinds, rewinds)
        resumed = trainer.step > 0
        if load_from is not None and not cfg.checkpoint.load_weights_only and trainer.step >= cfg.train.steps:
            if world.rank == 0:  # e.g. the run's own config.yaml passed back: nothing to do, and nothing is touched
                print(f"{run_dir}: the run is already at step {trainer.step} ({load_from.name}), at or past "
                      f"train.steps={cfg.train.steps}: nothing to train, nothing written; raise --train.steps to "
                      f"continue it", flush=True)
            trainer.data.close()
            return TrainResult()
        # Before the run writes anything: a signal from then on (a test, or SLURM, sees metrics.jsonl appear) is a
        # preemption, not the default kill.
        _install_signal_handlers(trainer)
        if world.rank == 0:  # only now, with every input checked, does the run write anything
            run.lock.keep_dirs()
            restarted = not resumed and (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite
            if resumed:
                _keep_metrics_until(run_dir / "metrics.jsonl", trainer.step)
            else:
                (run_dir / "metrics.jsonl").unlink(missing_ok=True)
                (run_dir / SKIPPED_FILE).unlink(missing_ok=True)
            (run_dir / "config.yaml").write_text(dump_yaml(cfg))
            trainer.tokenizer.save(run_dir)
            trainer.open_log(enabled=True, config_dict=to_dict(cfg))
            trainer.log.print(f"run dir {run_dir}")
            if restarted and load_from is None:
                trainer.log.print(f"note: {run_dir} holds a run stopped before its first checkpoint: starting it "
                                  f"again from step 0 (its metrics.jsonl replaced)")
            if load_from is not None:
                what = "weights of" if cfg.checkpoint.load_weights_only else "resuming from"
                trainer.log.print(f"{what} {load_from} (step {trainer.step}, {trainer.consumed_samples:,} samples; "
                                  f"read in {read_seconds:.2f}s)")
                was, now = run.run_state.get("cpu_threads"), torch.get_num_threads()
                if not cfg.checkpoint.load_weights_only and device.type == "cpu" and was and was != now:
                    trainer.log.print(f"note: {load_from.name} was written by a CPU run with {was} intra-op threads "
                                      f"and this one has {now}: the curve continues to rounding, not bitwise "
                                      f"(OMP_NUM_THREADS={was} resumes it exactly)")
            if data_changes:
                trainer.log.print("warning: data settings changed on resume (checkpoint.allow_data_change): "
                                  + "; ".join(data_changes))
                trainer.log.log({"step": trainer.step, "data_change": "; ".join(data_changes)})
        if world.rank == 0:
            (run_dir / PREEMPTED).unlink(missing_ok=True)
            if os.environ.get("SLURM_JOB_ID") and cfg.checkpoint.interval == 0:
                trainer.log.print(f"warning: SLURM job {os.environ['SLURM_JOB_ID']} runs with checkpoint.interval 0: "
                                  f"a preemption, time limit or requeue loses the run; set --checkpoint.interval N")
        try:
            result = trainer.fit()
        except StopMidStep as e:
            raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop_signal).name} in step "
                                           f"{trainer.step + 1}, {e}; nothing saved (checkpoint.interval 0), so "
                                           f"the run cannot be resumed", trainer.stop_signal) from None
        if result.preempted and cfg.checkpoint.interval == 0:
            raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop_signal).name} after step "
                                           f"{trainer.step}; nothing saved (checkpoint.interval 0), so the run cannot "
                                           f"be resumed", trainer.stop_signal)
        if result.preempted and world.rank == 0:
            # For job scripts: torchrun turns a worker's exit status into its own, so the marker file says it.
            (run_dir / PREEMPTED).write_text(f"step {trainer.step}\n")
        if world.world_size > 1:
            # Every rank done with every collective before any rank tears its process group down (the exit-time
            # gloo abort this guarded against came back with the barrier alone; see shutdown()). On the success
            # path only: after an error on one rank, a barrier would wait for the collective timeout.
            dist.barrier()
        return result
    except Exception as e:
        # A sibling worker that saw the agent go exits first, and this rank's next collective fails (connection
        # reset) before its own watcher wakes: the same event, said the same way, not an internal error.
        why = agent_gone(agent)
        if why is not None:
            orphaned(why)
        if isinstance(e, UserError) and getattr(e, "on_every_rank", False) and dist.is_initialized():
            _say_once(e)
        raise
    finally:
        if trainer is not None:  # (after an error: fit() closes them on its own way out)
            trainer.close()
        if run is not None and run.lock is not None:
            run.lock.release()
        trainer = None  # drop the model (and the process groups its DTensors hold) before the groups are destroyed
        shutdown()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


EVERY_RANK_ERROR_WAIT_S = 20  # the longest a rank other than 0 waits for rank 0 to say an error every rank has


def _say_once(e: UserError) -> None:
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


def cli(argv: list[str], hooks=()) -> int:
    """The command: its exit status (0 done, 2 a user's mistake, 3 diverged or past the spike limit, ...); hooks as
    main() takes them (tests/fault_drill.py)."""
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        try:
            cfg = load_config(argv)
        except UserError as e:
            e.on_every_rank = True  # every rank parses the same command line (torchrun and srun pass it to all)
            raise
        result = main(cfg, hooks=hooks)
    except (TrainingDiverged, SpikeLimit) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except StoppedWithoutCheckpoint as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except UserError as e:  # user-caused: one line; anything else is an internal error and keeps its traceback
        if getattr(e, "said", False):  # (main() said it, once, with the process group up: _say_once)
            return 2
        if not (getattr(e, "on_every_rank", False) and world_from_env().rank != 0):  # said once, by rank 0
            print(f"error: {e}", file=sys.stderr)
        elif world_from_env().world_size > 1:
            # The command line, refused before any process group exists: rank 0 refuses the same line, so wait to be
            # stopped with it (see _say_once); the bound only matters if no launcher stops this rank.
            time.sleep(EVERY_RANK_ERROR_WAIT_S)
        return 2
    return EXIT_PREEMPTED if result.preempted else 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
