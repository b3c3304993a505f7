"""Where a run's checkpoints lie: `<run.dir>/checkpoints/step_XXXXXXXX/`, complete once `COMPLETE` exists in it
(hybridpar.checkpoint.dcp writes them; this module names, lists and finds them)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from hybridpar.checkpoint.safe_load import CheckpointError

STEP_PREFIX = "step_"
STEP_DIR = re.compile(r"step_\d+")  # what hybridpar names a save; anything else in checkpoints/ is not one
MARKER = "COMPLETE"


def step_of(path: Path) -> int:
    """The step of a checkpoint directory step_XXXXXXXX."""
    return int(Path(path).name[len(STEP_PREFIX):])


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
            and is_complete(p)]  # a link is not a save of this run (it may lead anywhere)
    return sorted(done, key=step_of)


def remove_step_dir(path: Path) -> None:
    """Delete a step directory of the run: a link is unlinked, never followed (what it leads to is not the run's)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def resolve_load_path(path: str) -> Path:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    p = Path(path)
    if is_complete(p):
        return p
    latest = latest_checkpoint(p)
    if latest is not None:
        return latest
    if (p / ".metadata").is_file():
        raise CheckpointError(f"checkpoint.load={path!r} was not completed (no {MARKER} marker: the save was cut "
                              f"off); load the previous checkpoint of that run instead")
    raise CheckpointError(f"checkpoint.load={path!r} is neither a complete checkpoint nor a run directory holding "
                          f"one; give <run.dir>/checkpoints/step_XXXXXXXX or <run.dir>")


def regular_file_of(src_dir: Path, name: str) -> Path:
    """src_dir/name when it is a regular file, or a symlink to one inside src_dir; a link out of it (a crafted
    checkpoint pointing at a secret) or a non-file is a one-line CheckpointError. Check before writing anything."""
    src = Path(src_dir) / name
    real = src.resolve()
    if not real.is_file() or (src.is_symlink() and not real.is_relative_to(Path(src_dir).resolve())):
        raise CheckpointError(f"{src} is not a regular file of {src_dir} (a link out of it, or not a file); "
                              f"replace it with the file itself")
    return real


def optional_file_of(src_dir: Path, name: str) -> Path | None:
    """regular_file_of(src_dir, name) when src_dir holds that name (a link too, even a broken one); else None."""
    src = Path(src_dir) / name
    return regular_file_of(src_dir, name) if src.exists() or src.is_symlink() else None
