"""A run owns its run directory: `<run.dir>/.lock`, created exclusively at start and removed at exit.

The lock is a small JSON file (host, pid, the process's kernel start time, wall-clock start, SLURM job id and restart
count) made with O_CREAT | O_EXCL, which is atomic on local file systems and on the NFS (v3+) and Lustre mounts
clusters share, so it works where flock() may not reach across nodes. A lock left by a process that is gone is
taken over, with a message, when that can be known:
  - same host, and the pid is not running, or is a different process (its kernel start time differs: pid reuse);
  - same SLURM job with another restart count: SLURM runs one incarnation of a job at a time, so a requeued job
    takes over the lock its earlier incarnation left, on whichever node it lands.
A lock held by a live process, or from another host, is refused with one line naming the holder and how to clear it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from hybridpar.errors import RunDirError

LOCK = ".lock"


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the process name (state first), or None if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return stat.rsplit(")", 1)[1].split()  # the name in (...) may hold spaces


def _proc_start_ticks(pid: int) -> int | None:
    """The kernel start time of process `pid` (clock ticks since boot), or None if it does not exist."""
    fields = _proc_stat(pid)
    return None if fields is None else int(fields[19])  # field 22


def _alive(pid: int, start_ticks: int | None) -> bool:
    if Path("/proc/self/stat").exists():
        fields = _proc_stat(pid)  # a zombie (state Z) has exited: it only waits for its parent to reap it
        return fields is not None and fields[0] != "Z" and (start_ticks is None or int(fields[19]) == start_ticks)
    try:  # no /proc (macOS): signal 0 says whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _proc_start_ticks(os.getpid()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0")}


def _describe(h: dict) -> str:
    job = f", SLURM job {h['slurm_job_id']}" if h.get("slurm_job_id") else ""
    return f"pid {h.get('pid')} on host {h.get('host')} (started {h.get('started')}{job})"


def _stale_reason(h: dict) -> str | None:
    """Why the holder `h` is certainly gone, or None if it may still be running."""
    me = _owner()
    if h.get("slurm_job_id") and h["slurm_job_id"] == me["slurm_job_id"] and \
            str(h.get("slurm_restart_count")) != me["slurm_restart_count"]:
        return "an earlier incarnation of this SLURM job (requeued since)"
    if h.get("empty"):
        return "an empty lock (its starter stopped before writing it)"
    if h.get("host") == me["host"] and not (isinstance(h.get("pid"), int) and h["pid"] > 0):
        return f"its pid {h.get('pid')!r} is not a process id"
    if h.get("host") == me["host"] and not _alive(h["pid"], h.get("start_ticks")):
        return "that process is gone"
    return None


class RunDirLock:
    """Holds `<run_dir>/.lock` from acquire() to release(). release() also removes the directories acquire() had
    to create, if they are still empty, so a start that is refused later leaves no trace."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK
        self._created: list[Path] = []  # directories made by acquire(), outermost first
        self._content = ""

    def acquire(self, log=print) -> "RunDirLock":
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirError(f"run.dir={str(self.run_dir)!r} is a file, not a directory; pass a directory path "
                              f"(new or of an earlier run) as --run.dir")
        missing = [p for p in [self.run_dir, *self.run_dir.parents] if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RunDirError(f"run.dir={str(self.run_dir)!r}: a parent of it is a file; pass another --run.dir") \
                from None
        except OSError as e:  # permission denied, a read-only or a full file system
            raise RunDirError(f"run.dir={str(self.run_dir)!r} cannot be created ({e.strerror.lower()}); pass a "
                              f"writable --run.dir") from None
        self._created = list(reversed(missing))
        self._content = json.dumps(_owner()) + "\n"
        for _ in range(3):  # a takeover can race another starter: retry the exclusive create a few times
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale(log)
                continue
            except OSError as e:  # a read-only or full file system
                self.release()
                raise RunDirError(f"run.dir={str(self.run_dir)!r}: its lock cannot be created ({e.strerror.lower()}); "
                                  f"pass a writable --run.dir") from None
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(self._content)
            except OSError as e:  # a full disk: leave no empty lock behind to block the next start
                self.path.unlink(missing_ok=True)
                self._content = ""
                self.release()
                raise RunDirError(f"run.dir={str(self.run_dir)!r}: its lock cannot be written ({e.strerror}); free "
                                  f"space there or pass another --run.dir") from None
            return self
        raise RunDirError(f"run.dir={str(self.run_dir)!r}: another process took its lock at the same moment; "
                          f"only one run may use a run dir")

    def _read_holder(self) -> dict | None:
        for _ in range(20):  # a holder writes its lock right after creating it: give it a moment
            try:
                text = self.path.read_text()
            except FileNotFoundError:
                return None
            try:
                holder = json.loads(text)
                if isinstance(holder, dict):
                    return holder
            except json.JSONDecodeError:
                pass
            time.sleep(0.05)
        if text == "":  # still empty after a second: its starter died between creating and writing it
            return {"empty": True}
        self.release()
        raise RunDirError(f"{self.path} exists but is not a lock hybridpar wrote; if no run uses {self.run_dir}, "
                          f"delete {self.path} and start again")

    def _take_over_if_stale(self, log) -> None:
        holder = self._read_holder()
        if holder is None:
            return  # released meanwhile: try again
        reason = _stale_reason(holder)
        if reason is None:
            self.release()
            here = holder.get("host") == socket.gethostname()
            fix = ("wait for it to finish, stop it, or pass another --run.dir" if here else
                   f"if that run is no longer running, delete {self.path} and start again; else pass another --run.dir")
            raise RunDirError(f"run.dir={str(self.run_dir)!r} is in use by {_describe(holder)}: {fix}")
        # Move the stale lock aside atomically: of several starters only one succeeds; the others retry.
        aside = self.path.with_name(f"{LOCK}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            text = aside.read_text()
            taken = {"empty": True} if text == "" else json.loads(text)
        except (OSError, json.JSONDecodeError):
            taken = None
        if taken != holder:  # another starter replaced the stale lock in between: put its lock back and refuse
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink(missing_ok=True)
            self.release()
            raise RunDirError(f"run.dir={str(self.run_dir)!r} was just taken by another process; only one run "
                              f"may use a run dir")
        aside.unlink(missing_ok=True)
        log(f"run dir {self.run_dir}: taking over the lock of {_describe(holder)}: {reason}")

    def release(self) -> None:
        """Remove the lock if it is this process's, then the directories acquire() created if they are empty."""
        try:
            if self._content and self.path.read_text() == self._content:
                self.path.unlink()
        except FileNotFoundError:
            pass
        for d in reversed(self._created):  # innermost first
            try:
                d.rmdir()
            except OSError:
                break  # not empty (the run wrote into it) or already gone
        self._created, self._content = [], ""

    def keep_dirs(self) -> None:
        """The run has started: its directory stays even if it ends up empty."""
        self._created = []
