"""How far a reader walks through the code: measured on a real run of the default tiny model (2 steps, CPU, one
process), by tracing function calls in hybridpar/, models/ and launch/.

    python tools/code_walk.py            # run from the checkout to measure (it imports that checkout's code)

Two figures, each with the files behind it:
- the step path: the files whose functions run during one optimizer step (the second, Trainer.train_step, after
  start-up and the first step's one-off work), and their lines;
- the walk of the config from launch/pretrain_gpt.py's main: every call site that hands the config or a part of it
  (a Config, one of its sections, or the resolved Run) to a function, in the order first taken, each site once (a
  loop's or a step's repeats are one). A room is a file (of the function called); a stay is a run of such calls
  into one file (the next call into another file starts the next stay); a climb is a stay in a room the walk has
  already left (coming back to a file it was in before).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

ROOT = Path.cwd()
PARTS: tuple[str, ...] = ()  # hybridpar/, models/ (hybridpar.models, wherever it is installed from) and launch/


def ours(filename: str) -> bool:
    return filename.startswith(PARTS)


def rel(filename: str) -> str:
    for part in PARTS:
        if filename.startswith(part):
            return str(Path(Path(part).name) / Path(filename).relative_to(part))
    return filename


def carries_config(value) -> bool:
    """A Config, one of its section dataclasses, or a Run (which holds the resolved config)."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return False
    module = type(value).__module__
    return module.startswith("hybridpar.config") or type(value).__name__ in ("Run", "ModelConfig")


def main() -> int:
    global PARTS
    sys.path.insert(0, str(ROOT / "launch"))
    import pretrain_gpt
    import hybridpar.models
    import hybridpar.trainer
    from hybridpar.config.cli import load_config

    PARTS = (str(Path(hybridpar.__file__).parent) + "/", str(Path(hybridpar.models.__file__).parent) + "/",
             str(ROOT / "launch") + "/")

    calls: list[str] = []  # the file of each call that receives the config or a part of it
    seen: set[tuple] = set()
    step_files: set[str] = set()
    in_step = {"on": False, "n": 0}

    def profile(frame, event, _arg):
        if event != "call":
            return
        code = frame.f_code
        if not ours(code.co_filename):
            return
        if in_step["on"]:
            step_files.add(code.co_filename)
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        site = (frame.f_back.f_code.co_filename, frame.f_back.f_lineno, code.co_filename, code.co_name)
        if site not in seen and any(n != "self" and carries_config(frame.f_locals.get(n)) for n in names):
            seen.add(site)  # each call site once: a loop's or a step's repeats are one stay of the walk
            calls.append(code.co_filename)

    train_step = hybridpar.trainer.Trainer.train_step

    def traced_step(self, step, *args, **kwargs):
        in_step["n"] += 1
        in_step["on"] = in_step["n"] == 2
        try:
            return train_step(self, step, *args, **kwargs)
        finally:
            in_step["on"] = False

    hybridpar.trainer.Trainer.train_step = traced_step
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(["--train.steps", "2", "--train.eval_interval", "0", "--train.sample_tokens", "0",
                           "--logging.wandb.mode", "disabled", "--run.dir", str(Path(tmp) / "run")])
        sys.setprofile(profile)
        try:
            pretrain_gpt.main(cfg)
        finally:
            sys.setprofile(None)
    stays = [f for i, f in enumerate(calls) if i == 0 or calls[i - 1] != f]
    climbs = sum(1 for i, f in enumerate(stays) if f in stays[:i])
    lines = sum(len(Path(f).read_text().splitlines()) for f in step_files)
    print(f"step path: {len(step_files)} files, {lines} lines")
    for f in sorted(step_files):
        print(f"  {rel(f)}")
    print(f"config walk from main: {len(calls)} calls, {len(stays)} stays in {len(set(calls))} rooms, {climbs} climbs")
    print("  " + " > ".join(Path(f).stem for f in stays))
    return 0


if __name__ == "__main__":
    sys.exit(main())
