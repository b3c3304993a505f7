"""Score downstream tasks on a hybridpar checkpoint, on one process or any layout under torchrun.

    python launch/evaluate.py runs/default --tasks builtin:next-words
    python launch/evaluate.py runs/x --tasks hellaswag.jsonl lambada.jsonl wiki.txt --json results.json
    torchrun --nproc_per_node 4 launch/evaluate.py runs/x --tasks arc.jsonl --parallel.tp 2

CHECKPOINT is a run dir (its latest checkpoint), a checkpoint dir of any layout, a from-hf / from-megatron output
or a to-torch export. Tasks are JSONL files (multiple choice, cloze or perplexity; docs/evaluation.md), .txt files
(perplexity of one document) or builtin:next-words (from the built-in corpus's validation split, with the
checkpoint's data.split). --parallel.* and --train.precision / --train.device set the layout and numerics.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError, UserError
from hybridpar.models.config import doc


@dataclass(frozen=True)
class Options:
    checkpoint: list[str] = field(default_factory=list, metadata={"help": "a run dir, checkpoint dir or export"})
    tasks: list[str] = doc([], "task files or builtin:next-words (required)")
    batch_size: int = doc(16, "sequences per forward")
    max_len: Optional[int] = doc(None, "tokens of context per window; None = the checkpoint's train.seq_len")
    json: Optional[str] = doc(None, "also write the results to this JSON file")
    tokenizer: Optional[str] = doc(None, "tokenizer spec when the checkpoint holds none (bytes, bpe:PATH, ...)")


def parse(argv: list[str]):
    parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/evaluate.py", config=True,
                           positional="checkpoint")
    if parsed is None:
        return None
    a, cfg = parsed
    if any(arg.startswith("--model.") for arg in argv):
        raise ConfigError("the model is the checkpoint's: drop the --model.* flags")
    if len(a.checkpoint) != 1:
        raise ConfigError(f"give one CHECKPOINT (a run dir, checkpoint dir or export), not {len(a.checkpoint)}")
    if not a.tasks:
        raise ConfigError("give --tasks FILE [FILE ...] (task files or builtin:next-words)")
    if a.batch_size < 1 or (a.max_len is not None and a.max_len < 2):
        raise ConfigError(f"--batch-size {a.batch_size} must be >= 1 and --max-len {a.max_len} >= 2")
    if a.json is not None:  # checked now, not after the whole evaluation
        out = Path(a.json)
        if out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
            why = "is a directory" if out.is_dir() else ("is in no existing directory" if not out.parent.is_dir()
                                                         else "is in a directory this user cannot write")
            raise ConfigError(f"--json {a.json!r} {why}; give a file path in a writable directory")
    return a, cfg, any(arg.startswith("--data.") for arg in argv)


def main(a, cfg, own_data: bool) -> dict:
    import torch.distributed as dist

    from hybridpar.config.cli import config_from_dict
    from hybridpar.data.corpus import atomic_write
    from hybridpar.inference.evaluate import Scorer, run_task
    from hybridpar.inference.load import find_source, load_for_inference
    from hybridpar.inference.tasks import load_tasks
    from hybridpar.parallel.distributed import shutdown

    src = find_source(a.checkpoint[0])
    if not own_data and isinstance(src.saved.get("data"), dict):  # builtin tasks: the run's corpus split
        cfg = replace(cfg, data=config_from_dict({"data": src.saved["data"]}).data)
    tasks = load_tasks(a.tasks, cfg.data)  # every task read and checked before the model is loaded
    loaded = None
    try:
        loaded = load_for_inference(a.checkpoint[0], cfg, a.tokenizer)
        run = loaded.run
        max_len = a.max_len or run.cfg.train.seq_len
        if max_len > run.cfg.model.max_seq_len:
            raise ConfigError(f"--max-len {max_len} exceeds the model's context of {run.cfg.model.max_seq_len} "
                              f"tokens (model.max_seq_len)")
        rank0 = dist.get_rank() == 0

        def progress(done: int, total: int) -> None:
            if rank0:
                print(f"  {done:,} of {total:,} forwards", file=sys.stderr, flush=True)

        scorer = Scorer(loaded.model, loaded.mesh, run.device, loaded.tokenizer, max_len, a.batch_size,
                        loaded.autocast, run.layout.tp if run.cfg.parallel.sequence_parallel else 1, progress)
        if rank0:
            print(f"model {run.cfg.model.name} from {loaded.source.path} | mesh "
                  f"{dict(zip(loaded.mesh.mesh_dim_names, loaded.mesh.shape))} | {run.device} "
                  f"({run.cfg.train.precision}) | window {max_len} tokens, batch {a.batch_size}", flush=True)
        results = {}
        for task in tasks:
            if rank0:
                print(f"{task.name}: scoring {len(task.examples):,} examples ...", file=sys.stderr, flush=True)
            results[task.name] = m = run_task(task, scorer)
            if rank0:
                print(f"{task.name} ({task.kind.replace('_', ' ')}, {m['examples']} examples, {m['seconds']:.1f}s): "
                      + " ".join(f"{k} {v:.4f}" for k, v in m.items() if k not in ("examples", "seconds")),
                      flush=True)
        if rank0 and a.json:
            out = {"checkpoint": str(loaded.source.path), "layout": list(run.layout.degrees), "tasks": results}
            try:
                atomic_write(Path(a.json), json.dumps(out, indent=1) + "\n")  # whole or not at all
            except OSError as e:
                raise ConfigError(f"--json {a.json!r} could not be written ({e.strerror or e}); nothing was written "
                                  f"there, the results are printed above") from None
        if dist.get_world_size() > 1:
            dist.barrier()
        return results
    finally:
        loaded = None
        shutdown()


def cli(argv: list[str]) -> int:
    try:
        parsed = parse(argv)
        if parsed is None:
            return 0
        main(*parsed)
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:  # (every rank meets the same error: said once)
            print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:
            print("interrupted: evaluation stopped (--json not written)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
