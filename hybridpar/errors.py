"""The errors a user causes (a config value, a file, a busy run dir). The launchers print these as one line naming
the value and the fix, and exit 2; every other exception is an internal error and keeps its traceback."""

import errno
import os


class UserError(ValueError):
    """Base of every user-caused error."""


class ConfigError(UserError):
    """A config value that cannot work: printed as one line, exit status 2."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used as asked; the message names it and the fix."""


class DataError(UserError):
    """A data file or data setting that cannot be used; the message names the file and the fix."""


class RunDirError(UserError):
    """A run directory that this process may not use (another run holds it, or it is not a directory)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (its type name when it has none), for one-line errors."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def write_refused(e: OSError, what, fix: str, paths=()) -> "UserError | None":
    """A file system's refusal of a write (full, over quota, read-only; no permission on one of `paths`, the outputs)
    as a one-line error about writing `what`; None for any other OSError (an internal error: it keeps its
    traceback). A read's EACCES on an input is not a write's."""
    denied = e.errno == errno.EACCES and e.filename is not None and any(
        str(e.filename).startswith(str(p)) for p in paths)
    if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS) and not denied:
        return None
    reason = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else os.strerror(e.errno).lower()
    return UserError(f"writing {what}: {reason}; {fix}")
