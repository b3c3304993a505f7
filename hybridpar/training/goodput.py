"""Goodput: where every second of a run's wall clock went, across every start of it (<run.dir>/goodput.json).

The trainer measures each part of its loop and hands the seconds here; this record keeps the totals since the run's
first start, and what was lost when work was thrown away:

- productive: the steps of the run's history (what its final weights are made of);
- startup: each launch's start (launch/pretrain_gpt.py's first line, before its imports) to the loop's start
  (imports, process group, data, model, resume);
- data_wait: steps waiting on the data loader (taken out of the steps' time);
- checkpoint_stall: the step loop blocked by saves (an async save's synchronous part);
- evaluation: validation, task evaluations and the final sample;
- rewind: the rewinds themselves (restoring, a spike rerun's replay); rewind_redo: the productive time of the steps
  a rewind undid (they are trained again);
- restart_redo: the productive time of the steps a restart (preemption, kill, requeue) trained again: the steps after
  the checkpoint it resumed from, as the previous start recorded them;
- skipped_nonfinite: steps whose update was skipped (a non-finite gradient norm);
- down: between the last record of one start and the next start (a queue, a dead node; and a killed start's work
  after its last record);
- other: the wall clock less all of the above (logging, the loop's own bookkeeping).

goodput = productive / wall, wall = now - the first start. A start records at every log row and checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from hybridpar.errors import write_refused

PARTS = ("productive", "startup", "data_wait", "checkpoint_stall", "evaluation", "rewind", "rewind_redo",
         "restart_redo", "skipped_nonfinite", "down")
FILE = "goodput.json"


@dataclass
class Goodput:
    first_start: float
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    productive_at: dict[int, float] = field(default_factory=lambda: {0: 0.0})  # step -> productive seconds to it
    last_seen: float = 0.0
    unproductive: set[int] = field(default_factory=set)  # this start's steps whose update was skipped
    notes: list[str] = field(default_factory=list)  # what begin() has to say (a damaged file)

    @classmethod
    def begin(cls, run_dir: Path | None, started: float, step: int) -> "Goodput":
        """The record of a start at `started` (time.time()) that continues from step `step` (0: from scratch), with
        what `run_dir`'s goodput.json says of the earlier starts (None: keep nothing on disk)."""
        g = cls(first_start=started)
        saved = _read(run_dir, g.notes) if run_dir is not None else None
        if saved is not None:
            g.first_start, g.seconds = saved["first_start"], {p: saved["seconds"].get(p, 0.0) for p in PARTS}
            g.productive_at = {int(k): v for k, v in saved["productive_at"].items()}
            g.seconds["down"] += max(0.0, started - saved["last_seen"])
            kept = g.productive_at.get(step)
            if kept is None:  # (the record lacks that checkpoint: keep the productive time it has)
                kept = g.seconds["productive"] if step >= max(g.productive_at) else 0.0
            lost = max(0.0, g.seconds["productive"] - kept)
            g.seconds["restart_redo"] += lost
            g.seconds["productive"] -= lost
            g.productive_at = {s: v for s, v in g.productive_at.items() if s <= step}
        g.productive_at[step] = g.seconds["productive"]
        g.last_seen = started
        return g

    def add(self, part: str, seconds: float) -> None:
        self.seconds[part] += max(0.0, seconds)

    @contextmanager
    def timed(self, part: str):
        """The block's seconds to `part`."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - began)

    def step_took(self, step: int, seconds: float, waited: float) -> None:
        """Step `step` took `seconds`, `waited` of them on data."""
        self.stepped(step, seconds - waited)
        self.add("data_wait", waited)

    def stepped(self, step: int, seconds: float) -> None:
        """Step `step` took `seconds` more (its training; then its log row): productive, unless its update was
        skipped already (skipped() may come before or after the step's time)."""
        part = "skipped_nonfinite" if step in self.unproductive else "productive"
        self.seconds[part] += max(0.0, seconds)
        self.productive_at[step] = self.seconds["productive"]

    def skipped(self, step: int) -> None:
        """Step `step`'s update was skipped: its time, recorded so far or still to come, is not productive. A later
        rewind past it does not count it again (it was lost once, here)."""
        self.unproductive.add(step)
        if step in self.productive_at and step - 1 in self.productive_at:
            lost = self.productive_at[step] - self.productive_at[step - 1]
            self.seconds["productive"] -= lost
            self.seconds["skipped_nonfinite"] += lost
            for s in self.productive_at:
                if s >= step:
                    self.productive_at[s] -= lost

    def rewound(self, target: int, seconds: float) -> None:
        """A rewind to step `target` took `seconds`; the steps after it are trained again."""
        kept = self.productive_at.get(target, self.seconds["productive"])
        self.seconds["rewind_redo"] += self.seconds["productive"] - kept
        self.seconds["productive"] = kept
        self.productive_at = {s: v for s, v in self.productive_at.items() if s <= target}
        self.unproductive = {s for s in self.unproductive if s <= target}  # (the steps after it are new ones)
        self.add("rewind", seconds)

    def row(self, now: float | None = None) -> dict:
        """The metrics row's fields: each part in seconds, the wall clock, other, and goodput."""
        now = time.time() if now is None else now
        wall = now - self.first_start
        out = {f"goodput/{p}_s": round(self.seconds[p], 3) for p in PARTS}
        out["goodput/wall_s"] = round(wall, 3)
        out["goodput/other_s"] = round(wall - sum(self.seconds.values()), 3)
        out["goodput"] = self.seconds["productive"] / wall if wall > 0 else 0.0
        return out

    def save(self, run_dir: Path, checkpoints: list[int]) -> None:
        """Record (rank 0): the totals, now, and the productive time at each of the run's checkpoints."""
        self.last_seen = time.time()
        last = max(self.productive_at)
        keep = {s: v for s, v in self.productive_at.items() if s in checkpoints or s == last or s == 0}
        tmp = Path(run_dir) / f".{FILE}.tmp"
        try:
            tmp.write_text(json.dumps({"first_start": self.first_start, "last_seen": self.last_seen,
                                       "seconds": self.seconds, "productive_at": {str(k): v for k, v in keep.items()}})
                           + "\n")
            os.replace(tmp, Path(run_dir) / FILE)
        except OSError as e:  # a full or read-only file system: one line; the last complete record stays
            tmp.unlink(missing_ok=True)
            raise write_refused(e, Path(run_dir) / FILE, "free space there, then start the same command again (it "
                                "resumes from the latest complete checkpoint)") or e


MAX_BYTES = 1 << 20


def _read(run_dir: Path, notes: list[str]) -> dict | None:
    path = Path(run_dir) / FILE
    if not path.exists():
        return None
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        with open(path, "rb") as f:  # (a record is a few hundred bytes: a larger file is not one)
            text = f.read(MAX_BYTES + 1)
        if len(text) > MAX_BYTES:
            raise ValueError(f"larger than {MAX_BYTES:,} bytes")
        saved = json.loads(text)
        numbers = [saved["first_start"], saved["last_seen"], *saved["seconds"].values(),
                   *saved["productive_at"].values()]
        if not all(type(v) in (int, float) and math.isfinite(v) and v >= 0 for v in numbers) or not all(
                k.isdigit() for k in saved["productive_at"]) or saved["last_seen"] < saved["first_start"]:
            raise ValueError("a value that is not a time")
        return saved
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        notes.append(f"warning: {path} is unreadable ({type(e).__name__}: {str(e)[:80]}); the time accounting "
                     f"starts again from this start")
        return None


@dataclass
class Clock:
    """The loop's timers: the data waits of train steps (since the last log row, and since the start), and where
    the interval a log row's throughput covers began (time, step)."""
    data_wait: float = 0.0
    data_wait_total: float = 0.0
    since: float = 0.0
    since_step: int = 0

    def waited(self, seconds: float) -> None:
        """A train step waited `seconds` on its data."""
        self.data_wait += seconds
        self.data_wait_total += seconds

    def take_data_wait(self) -> float:
        """The seconds train steps waited on data since the last call (or log row); counting starts again."""
        seconds, self.data_wait = self.data_wait, 0.0
        return seconds

    def mark(self, step: int | None = None) -> float:
        self.since = time.perf_counter()
        self.since_step = self.since_step if step is None else step
        return self.since
