"""Warm launcher processes: worlds of 1, 2 and 4 Python processes started once per test session (torch, hybridpar
and megatron-core imported once), each running launch/<script>.py jobs as `python launch/<script>.py ...` or
`torchrun --standalone --nproc_per_node N launch/<script>.py ...` would: its own environment (torchrun's rank
variables, a fresh rendezvous port), working directory, arguments, stdout and stderr (file descriptors 1 and 2, so
what C++ prints is caught too) and exit status. conftest.run_cli sends a launcher command here unless the test passes
its own environment or directory, or asks for a real process (warm=False): signals, kill -9, the torchrun agent, a
read-only disk and the one real torchrun launch per world size stay real processes.

Between jobs a worker restores what a job may install process-wide: environment, working directory, signal
handlers, sys.argv, the numerics flags (deterministic algorithms, TF32), torch.compile's caches, and a process
group the job left (reported: the launcher destroys its own). A job that outlives its siblings' failure by
GRACE_S (a collective waiting on a rank that exited, where torchrun's agent would end the others), or its timeout,
costs its world a restart, as does a worker that dies."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRACE_S = 20.0
SIGNALS = [s for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)]


# -- the worker (this file run as a script) --------------------------------------------------------------------

def _send(f, obj) -> None:
    blob = json.dumps(obj).encode()
    f.write(struct.pack("<Q", len(blob)) + blob)
    f.flush()


def _recv(f):
    head = f.read(8)
    if len(head) < 8:
        raise EOFError
    return json.loads(f.read(struct.unpack("<Q", head)[0]))


def _run_job(script: str, argv: list[str], env: dict, cwd: str) -> tuple[int, str, str, list[str]]:
    import runpy
    import traceback

    import torch
    import torch.distributed as dist

    import threading

    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_signals = {s: signal.getsignal(s) for s in SIGNALS}
    files_before, threads_before = _open_files(), set(threading.enumerate())
    leftovers = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        fd1, fd2 = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            sys.argv = [script, *argv]
            try:
                runpy.run_path(script, run_name="__main__")
                rc = 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:  # an internal error: its traceback, as the interpreter would print it
                traceback.print_exc()
                rc = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(fd1, 1), os.dup2(fd2, 2)
            os.close(fd1), os.close(fd2)
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
            sys.argv = saved_argv
            for s, handler in saved_signals.items():
                if signal.getsignal(s) is not handler:
                    signal.signal(s, handler)
            if dist.is_initialized():
                leftovers.append("a process group")
                dist.destroy_process_group()
            torch.use_deterministic_algorithms(False)
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
            torch._dynamo.reset()
        out.seek(0), err.seek(0)
        import gc

        gc.collect()  # what only a reference cycle still holds is garbage, not a leak
        leftovers += [f"open file {f}" for f in sorted(set(_open_files()) - set(files_before))]
        leftovers += [f"thread {t.name}" for t in set(threading.enumerate()) - threads_before
                      if t.is_alive() and t.name.startswith("hybridpar")]
        return rc, out.read().decode(errors="replace"), err.read().decode(errors="replace"), leftovers


def _open_files() -> list[str]:
    """The regular files this process holds open (what a job must close: a run dir's files keep a disk busy), but
    for the Python installation's own (a library's caches, such as matplotlib's fonts, are kept on purpose)."""
    installed = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix})
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if (target.startswith("/") and not target.startswith(("/dev/", "/proc/", *installed))
                and os.path.isfile(target)):
            out.append(target)
    return out


def _worker() -> None:
    """Reads jobs from stdin, answers on the pipe named by fd argv[1]; imports what every launcher imports first."""
    import torch  # noqa: F401
    import hybridpar.trainer  # noqa: F401  (torch.distributed, the models, the data layer)
    import megatron.core  # noqa: F401

    answers = os.fdopen(int(sys.argv[1]), "wb")
    requests = sys.stdin.buffer
    _send(answers, "ready")
    while True:
        try:
            job = _recv(requests)
        except EOFError:
            return
        _send(answers, _run_job(*job))


# -- the pool (in the test process) ----------------------------------------------------------------------------

class World:
    """n warm workers; run() gives each the same job with its rank's environment."""

    def __init__(self, n: int):
        self.n = n
        self.procs: list[tuple[subprocess.Popen, object]] = []
        self.starts = 0

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
        if self.n > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun sets for its workers
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        for _ in range(self.n):
            r, w = os.pipe()
            proc = subprocess.Popen([sys.executable, str(Path(__file__)), str(w)], cwd=ROOT, env=env,
                                    stdin=subprocess.PIPE, pass_fds=(w,), start_new_session=True)
            os.close(w)
            answers = os.fdopen(r, "rb")
            self.procs.append((proc, answers))
        for proc, answers in self.procs:
            if _recv(answers) != "ready":
                raise RuntimeError("a warm worker did not start")
        self.starts += 1

    def stop(self) -> None:
        for proc, answers in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the worker and anything it started
                proc.wait()
            answers.close()
            if proc.stdin:
                proc.stdin.close()
        self.procs = []

    def run(self, script: str, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        if not self.procs:
            self._start()
        port = _free_port()
        for rank, (proc, _) in enumerate(self.procs):
            rank_env = dict(env)
            if self.n > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.n),
                                LOCAL_WORLD_SIZE=str(self.n), GROUP_RANK="0", ROLE_RANK=str(rank),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            _send(proc.stdin, [script, argv, rank_env, str(ROOT)])
        results: dict[int, tuple] = {}
        deadline, failed_at = time.time() + timeout, None
        while len(results) < self.n:
            pending = {answers.fileno(): rank for rank, (_, answers) in enumerate(self.procs) if rank not in results}
            ready, _, _ = select.select(list(pending), [], [], 0.5)
            for fd in ready:
                rank = pending[fd]
                try:
                    results[rank] = tuple(_recv(self.procs[rank][1]))
                except EOFError:  # the worker died (os._exit, a crash)
                    results[rank] = (-9, "", f"warm worker {rank} died\n", [])
            if failed_at is None and any(r[0] != 0 for r in results.values()):
                failed_at = time.time()
            now = time.time()
            if now > deadline or (failed_at is not None and now - failed_at > GRACE_S):
                for rank in range(self.n):  # the ones still waiting: ended, as torchrun's agent ends them
                    results.setdefault(rank, (-15, "", f"warm worker {rank} stopped after {now - failed_at:.0f}s "
                                                       f"(a sibling failed)\n" if failed_at else
                                                       f"warm worker {rank} timed out\n", []))
                self.stop()
                if now > deadline:
                    raise subprocess.TimeoutExpired([script, *argv], timeout)
        if any(r[0] == -9 for r in results.values()):
            self.stop()
        codes = [results[r][0] for r in range(self.n)]
        rc = codes[0] if self.n == 1 else (0 if all(c == 0 for c in codes) else 1)
        stdout = "".join(results[r][1] for r in range(self.n))
        stderr = "".join(results[r][2] for r in range(self.n))
        if self.n > 1 and rc:
            stderr += "".join(f"warm world: rank {r} exitcode  : {c}\n" for r, c in enumerate(codes) if c)
        leftovers = sorted({x for r in results.values() for x in r[3]})
        if leftovers:  # what a real process would have lost at exit is a leak in-process: the test fails on it
            self.stop()
            raise AssertionError(f"{script} {' '.join(argv)[:200]}: the job left {', '.join(leftovers)} behind "
                                 f"(close it on every path out)\n{stderr[-2000:]}")
        return subprocess.CompletedProcess([script, *argv], rc, stdout, stderr)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORLDS: dict[int, World] = {}


def warm_command(args: list[str]) -> tuple[int, str, list[str]] | None:
    """(world size, script, its arguments) of a launcher command the warm worlds run, or None: `launch/X.py ...`, or
    `-m torch.distributed.run --standalone --nproc_per_node=N launch/X.py ...` with N in 2, 4."""
    args = [str(a) for a in args]
    n = 1
    if args[:3] == ["-m", "torch.distributed.run", "--standalone"] and len(args) > 4:
        flag = args[3]
        if not flag.startswith("--nproc_per_node=") or not flag.partition("=")[2].isdigit():
            return None
        n, args = int(flag.partition("=")[2]), args[4:]
        if n not in (2, 4):
            return None
    if not args or not (args[0].startswith("launch/") and args[0].endswith(".py")):
        return None
    return n, args[0], args[1:]


def run_warm(n: int, script: str, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    world = WORLDS.get(n)
    if world is None:
        world = WORLDS[n] = World(n)
    return world.run(script, argv, env, timeout)


def stop_all() -> None:
    for world in WORLDS.values():
        world.stop()


if __name__ == "__main__":
    _worker()
