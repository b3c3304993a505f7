"""Pretrain a GPT with hybridpar.

    python launch/pretrain_gpt.py                                  # tiny model on the built-in corpus
    python launch/pretrain_gpt.py --config configs/gpt2-124m.yaml --train.steps 1000
    python launch/pretrain_gpt.py --help                           # every field, its docstring and default
"""

from __future__ import annotations

import time

STARTED = time.time()  # this launch's start, before its imports: the goodput record's startup counts from here

import signal  # noqa: E402
import sys  # noqa: E402

from hybridpar.config import Config  # noqa: E402
from hybridpar.config.cli import help_text, load_config  # noqa: E402
from hybridpar.errors import UserError  # noqa: E402
from hybridpar.parallel.distributed import world_from_env  # noqa: E402
from hybridpar.session import EVERY_RANK_ERROR_WAIT_S, Session  # noqa: E402
from hybridpar.trainer import TrainResult  # noqa: E402
from hybridpar.training.step_status import TrainingDiverged  # noqa: E402
from hybridpar.checkpoint.recovery import SpikeLimit  # noqa: E402
from hybridpar.training.microbatch import StopMidStep  # noqa: E402


EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1/SIGINT after saving: requeue me (EX_TEMPFAIL)
# (hybridpar.session: 76 a second signal during the preemption save, 77 the torchrun agent died.) Stopped by a signal
# with nothing saved (checkpoint.interval 0): 128 + the signal's number, the shell's convention for "ended by a
# signal", so that a requeue wrapper waiting for 75 does not restart the run from step 0.


class StoppedWithoutCheckpoint(Exception):
    """A signal stopped a run that saves no checkpoints: nothing to resume from."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def main(cfg: Config) -> TrainResult:
    """Train with `cfg` on the processes the launcher started (one without a launcher)."""
    with Session() as session:
        return _train(session, cfg)  # (its frame, holding the trainer, ends before the session shuts down)


def _train(session: Session, cfg: Config) -> TrainResult:
    """The session's trainer, resumed, then fit(); a stop with nothing saved is an error with the signal's exit code."""
    trainer, data_changes, read_seconds = session.start(cfg)
    if session.finished():
        return TrainResult()
    # Before the run writes anything: a signal from then on (a test, or SLURM, sees metrics.jsonl appear) is a
    # preemption, not the default kill.
    session.catch_signals()
    session.open_run_dir(data_changes, read_seconds)
    saving = trainer.cfg.checkpoint.interval > 0
    try:
        result = trainer.fit(started=STARTED)
    except StopMidStep as e:
        raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop_signal).name} in step "
                                       f"{trainer.state.step + 1}, {e}; nothing saved (checkpoint.interval 0), so "
                                       f"the run cannot be resumed", trainer.stop_signal) from None
    if result.preempted and not saving:
        raise StoppedWithoutCheckpoint(f"stopped by {signal.Signals(trainer.stop_signal).name} after step "
                                       f"{trainer.state.step}; nothing saved (checkpoint.interval 0), so the run "
                                       f"cannot be resumed", trainer.stop_signal)
    if result.preempted:
        session.mark_preempted()
    return result


def cli(argv: list[str]) -> int:
    """The command: its exit status (0 done, 2 a user's mistake, 3 diverged or past the spike limit, ...)."""
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        try:
            cfg = load_config(argv)
        except UserError as e:
            e.on_every_rank = True  # every rank parses the same command line (torchrun and srun pass it to all)
            raise
        result = main(cfg)
    except (TrainingDiverged, SpikeLimit) as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    except StoppedWithoutCheckpoint as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except UserError as e:  # user-caused: one line; anything else is an internal error and keeps its traceback
        if getattr(e, "said", False):  # (the session said it, once, with the process group up: say_once)
            return 2
        if not (getattr(e, "on_every_rank", False) and world_from_env().rank != 0):  # said once, by rank 0
            print(f"error: {e}", file=sys.stderr)
        elif world_from_env().world_size > 1:
            # The command line, refused before any process group exists: rank 0 refuses the same line, so wait to be
            # stopped with it (see hybridpar.session.say_once); the bound only matters if no launcher stops this rank.
            time.sleep(EVERY_RANK_ERROR_WAIT_S)
        return 2
    return EXIT_PREEMPTED if result.preempted else 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
