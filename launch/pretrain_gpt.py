"""Pretrain a GPT with hybridpar.

    python launch/pretrain_gpt.py                                  # tiny model on the built-in corpus
    python launch/pretrain_gpt.py --config configs/gpt2-124m.yaml --train.steps 1000
    python launch/pretrain_gpt.py --help                           # every field, its docstring and default
"""

from __future__ import annotations

import time

STARTED = time.time()  # this launch's start, before its imports: the goodput record's startup counts from here

import sys  # noqa: E402

from hybridpar.config import Config  # noqa: E402
from hybridpar.config.cli import help_text, load_config  # noqa: E402
from hybridpar.errors import UserError  # noqa: E402
from hybridpar.parallel.distributed import world_from_env  # noqa: E402
from hybridpar.session import EVERY_RANK_ERROR_WAIT_S, Session, StoppedWithoutCheckpoint  # noqa: E402
from hybridpar.training.state import TrainResult  # noqa: E402
from hybridpar.training.step_status import TrainingDiverged  # noqa: E402


EXIT_PREEMPTED = 75  # stopped by SIGTERM/SIGUSR1/SIGINT after saving: requeue me (EX_TEMPFAIL)
# (hybridpar.session: 76 a second signal during the preemption save, 77 the torchrun agent died; a signal with
# nothing saved: 128 + the signal's number, StoppedWithoutCheckpoint.)


def main(cfg: Config) -> TrainResult:
    """Train with `cfg` on the processes the launcher started (one without a launcher)."""
    with Session() as session:
        return session.train(cfg, started=STARTED)


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
    except TrainingDiverged as e:  # (a spike past spike.max_rewinds is one too)
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
