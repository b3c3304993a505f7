"""lm-evaluation-harness with hybridpar's model type registered: the same arguments as `lm_eval`.

    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --tasks hellaswag --batch_size 16
    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --include_path my_tasks/ --tasks mine
    torchrun --nproc_per_node 2 launch/harness.py --model hybridpar --model_args checkpoint=runs/x,tp=2 --tasks ...

model_args: checkpoint (a run dir, checkpoint dir or export), max_length, tokenizer, dp_replicate, dp_shard, tp,
sequence_parallel, precision, device (hybridpar/interop/lm_eval.py). Needs the eval extra: pip install -e ".[eval]".
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

# lm-eval options whose files are pickles it reads back (SqliteDict's pickled responses, dill-pickled requests): a
# file planted there would run code, so they are refused.
PICKLED_CACHES = ("--use_cache", "-c", "--cache_requests")
# what only rank 0 may do: every rank computes the same results (they all score every request together)
RANK_ZERO_ONLY = {"--output_path": 1, "-o": 1, "--log_samples": 0, "-s": 0, "--wandb_args": 1,
                  "--wandb_config_args": 1, "--hf_hub_log_args": 1}


def _refused(argv: list[str]) -> str | None:
    for a in argv:
        if a.split("=")[0] in PICKLED_CACHES:
            return (f"{a.split('=')[0]}: lm-eval keeps that cache as pickles, which run code when read back; "
                    f"hybridpar's harness does not use it (leave the option out)")
    return None


def _for_rank(argv: list[str], rank: int) -> list[str]:
    """argv without the options that write results or logs, on every rank but 0."""
    if rank == 0:
        return argv
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
        elif a.split("=")[0] in RANK_ZERO_ONLY:
            skip = 0 if "=" in a else RANK_ZERO_ONLY[a]
        else:
            out.append(a)
    return out


def _option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """The values given to an option (`--x a b`, `--x=a,b`), split at commas; [] when it is absent."""
    out, taking = [], False
    for a in argv:
        if a.split("=")[0] in names:
            taking = "=" not in a
            out += a.split("=", 1)[1].split(",") if "=" in a else []
        elif taking and not a.startswith("-"):
            out += a.split(",")
        else:
            taking = False
    return [v for v in out if v]


def _index_include_path_only(argv: list[str]) -> None:
    """When every task named is a task (not a group, tag or file) that --include_path defines, lm-eval indexes only
    that path: its ~13,000 built-in task files are never read (indexing them took 23 s of a 30 s evaluation of four
    local tasks on a 2-core machine). Anything else (a built-in task, a group, a path) keeps lm-eval's full index."""
    include, tasks = _option(argv, ("--include_path",)), _option(argv, ("--tasks", "-t"))
    if len(include) != 1 or not tasks:
        return
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=include[0], include_defaults=False).all_subtasks
    if all(t in local for t in tasks):
        class IncludePathOnly(TaskManager):
            def __init__(self, *args, include_defaults: bool = False, **kwargs):
                super().__init__(*args, include_defaults=include_defaults, **kwargs)

        lm_eval.tasks.TaskManager = IncludePathOnly  # lm-eval's command line builds its manager from here


def _first_label_past_choices(task) -> str | None:
    """What is wrong when a task's first document names a choice it does not have, else None."""
    try:
        doc = task.task_docs[0]
        target = task.doc_to_target(doc)
        choices = task.doc_to_choice(doc) if task.config.doc_to_choice is not None else None
    except Exception:  # noqa: BLE001  (the IndexError was another one: it keeps its traceback)
        return None
    if not isinstance(target, int) or not isinstance(choices, list) or -len(choices) <= target < len(choices):
        return None
    return (f"task {task.config.task}: its first document's target is {target}, past its {len(choices)} choices; "
            f"give a label from 0 to {len(choices) - 1}")


@contextmanager
def _labels_named():
    """lm-eval builds a task by looking its first document's label up in that document's choices: a label past them
    was a bare IndexError from lm-eval's task.py. Said in one line, naming the task and the label. (A later document's
    label past its choices is lm-eval's own warning, and that document counts as wrong.)"""
    from lm_eval.api.task import ConfigurableTask

    from hybridpar.errors import UserError

    build = ConfigurableTask.__init__

    def checked(self, *args, **kwargs):
        try:
            build(self, *args, **kwargs)
        except IndexError:
            why = _first_label_past_choices(self)
            if why is None:
                raise
            raise UserError(why) from None

    ConfigurableTask.__init__ = checked
    try:
        yield
    finally:
        ConfigurableTask.__init__ = build


def main() -> int:
    # Python put launch/ first on sys.path, and launch/evaluate.py would shadow Hugging Face's `evaluate` package,
    # which lm-eval imports for some metrics: this command needs nothing from launch/.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    try:
        import lm_eval.__main__ as harness
    except ImportError:
        print('error: lm-evaluation-harness is not installed: pip install -e ".[eval]"', file=sys.stderr)
        return 2
    why = _refused(sys.argv[1:])
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    sys.argv[1:] = _for_rank(sys.argv[1:], rank)
    if rank != 0:
        sys.stdout = open(os.devnull, "w")  # one results table, from rank 0
    _index_include_path_only(sys.argv[1:])
    import hybridpar.interop.lm_eval  # noqa: F401  (registers --model hybridpar)
    from hybridpar.errors import UserError
    from hybridpar.parallel.distributed import shutdown

    try:
        with _labels_named():
            harness.cli_evaluate()
    except UserError as e:
        if rank == 0:  # (every rank meets the same error: said once)
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
