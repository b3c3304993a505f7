"""Warm launcher processes: worlds of 1 to 4 Python processes started once per test session (torch, hybridpar
and megatron-core imported once), each running launch/<script>.py jobs as `python launch/<script>.py ...` or
`torchrun --standalone --nproc_per_node N launch/<script>.py ...` would: its own environment (torchrun's rank
variables, a fresh rendezvous port), working directory, arguments, stdout and stderr (file descriptors 1 and 2, so
what C++ prints is caught too) and exit status. conftest.run_cli sends a launcher command here unless the test passes
its own environment or directory, or asks for a real process (warm=False): signals, kill -9, the torchrun agent, a
read-only disk and the one real torchrun launch per world size stay real processes. spawn() is
torch.multiprocessing.spawn on the same worlds: multi-rank parity jobs (a function of a test module per rank) run
there too.

Between jobs a worker restores what a job may install process-wide: environment, working directory, signal
handlers, sys.argv, torch's thread count and default RNG state (a fresh interpreter's), the numerics flags
(deterministic algorithms, TF32), torch.compile's and DTensor's caches, and a process group the job left
(reported: the launcher destroys its own). A job that outlives its siblings' failure by GRACE_S (a collective
waiting on a rank that exited, where torchrun's agent would end the others), or its timeout, costs its world a
restart, as does a worker that dies."""

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
RESULTS = "<results>"  # in a call's arguments: the dict the call fills, sent back to the caller
_PRISTINE_RNG = None
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


def _run_job(kind: str, *job) -> tuple[int, str, str, list[str]]:
    """Runs one job with fds 1 and 2 caught and what it installs process-wide put back: ("script", path, argv, env,
    cwd) as `python path argv...` would, or ("call", module, name, rank, args_file, results_file, env, cwd):
    module.name(rank, *args), the arguments read from args_file by torch.load, where the string RESULTS stands for
    a dict the call fills and this worker saves to results_file. Returns (exit status, stdout, stderr, what it
    left behind)."""
    import importlib
    import runpy
    import threading
    import traceback

    import torch
    import torch.distributed as dist

    env, cwd = job[-2:]
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_signals = {s: signal.getsignal(s) for s in SIGNALS}
    saved_threads = torch.get_num_threads()
    torch.set_rng_state(_PRISTINE_RNG)  # as a fresh interpreter's (torch seeds its default generator with a constant)
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
            try:
                if kind == "script":
                    script, argv = job[:2]
                    sys.argv = [script, *argv]
                    runpy.run_path(script, run_name="__main__")
                else:
                    module, name, rank, args_file, results_file = job[:5]
                    fn = importlib.import_module(module)
                    for part in name.split("."):
                        fn = getattr(fn, part)
                    results: dict = {}
                    args = [results if a == RESULTS else a for a in torch.load(args_file, weights_only=True)]
                    fn(rank, *args)
                    torch.save(results, results_file)
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
            # DTensor caches each op's output placements keyed by a mesh that compares equal to the next job's mesh
            # of the same shape: a hit would hand back a mesh whose process groups the job above destroyed.
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
            torch.set_num_threads(saved_threads)
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

    global _PRISTINE_RNG
    _PRISTINE_RNG = torch.get_rng_state()
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
        env = user_env()
        if self.n > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun sets for its workers
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")]))
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

    def run(self, job, label: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        """Gives rank r the job job(r) (see _run_job) with its rank's environment, in cwd; label names it in
        messages."""
        if not self.procs:
            self._start()
        port = _free_port()
        for rank, (proc, _) in enumerate(self.procs):
            rank_env = dict(env)
            if self.n > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.n),
                                LOCAL_WORLD_SIZE=str(self.n), GROUP_RANK="0", ROLE_RANK=str(rank),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            _send(proc.stdin, [*job(rank), rank_env, str(cwd)])
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
                    raise subprocess.TimeoutExpired(label, timeout)
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
            raise AssertionError(f"{' '.join(label)[:200]}: the job left {', '.join(leftovers)} behind "
                                 f"(close it on every path out)\n{stderr[-2000:]}")
        return subprocess.CompletedProcess(label, rc, stdout, stderr)


def user_env(env: dict | None = None) -> dict:
    """`env` (default this process's environment) without torchrun's rank variables, as a user's shell has it."""
    rank_variables = ("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_")
    return {k: v for k, v in (env or os.environ).items() if not k.startswith(rank_variables)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORLDS: dict[int, World] = {}


def warm_command(args: list[str]) -> tuple[int, str, list[str]] | None:
    """(world size, script's path, its arguments) of a launcher command the warm worlds run, or None: `launch/X.py
    ...` (or its absolute path), or `-m torch.distributed.run --standalone --nproc_per_node=N launch/X.py ...` with
    N from 2 to 4."""
    args = [str(a) for a in args]
    n = 1
    if args[:3] == ["-m", "torch.distributed.run", "--standalone"] and len(args) > 4:
        flag = args[3]
        if not flag.startswith("--nproc_per_node=") or not flag.partition("=")[2].isdigit():
            return None
        n, args = int(flag.partition("=")[2]), args[4:]
        if not 2 <= n <= 4:
            return None
    if not args or not args[0].endswith(".py") or (ROOT / args[0]).parent != ROOT / "launch":
        return None
    return n, str(ROOT / args[0]), args[1:]


def _world(n: int) -> World:
    if n not in WORLDS:
        WORLDS[n] = World(n)
    return WORLDS[n]


def run_warm(n: int, script: str, argv: list[str], env: dict, timeout: float,
             cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return _world(n).run(lambda rank: ["script", script, argv], [script, *argv], env, timeout, cwd)


class Results(dict):
    """The results argument of a spawn(): each rank's call fills a plain dict in its place; spawn() merges them in."""


def spawn(fn, args: tuple = (), nprocs: int = 1, timeout: float = 900) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs) on the warm world of nprocs ranks: rank r calls fn(r, *args).
    fn is a module-level function of a test module; args go through torch.save (tensors, containers, numbers,
    strings); a Results among them comes back filled with what the ranks put in it. A rank's exception fails the
    caller with that rank's traceback."""
    with tempfile.TemporaryDirectory(prefix="hybridpar-spawn-") as tmp:
        import torch

        args_file = os.path.join(tmp, "args.pt")
        torch.save([RESULTS if isinstance(a, Results) else a for a in args], args_file)
        out = [os.path.join(tmp, f"results{r}.pt") for r in range(nprocs)]
        label = [f"{fn.__module__}.{fn.__qualname__}"]
        job = lambda rank: ["call", fn.__module__, fn.__qualname__, rank, args_file, out[rank]]  # noqa: E731
        done = _world(nprocs).run(job, label, user_env(), timeout)
        if done.returncode != 0:
            raise AssertionError(f"{label[0]} failed on {nprocs} warm rank(s):\n{done.stderr[-6000:]}")
        filled = [torch.load(f, weights_only=True) for f in out]
        for a in args:
            if isinstance(a, Results):
                for part in filled:
                    a.update(part)


def stop_all() -> None:
    for world in WORLDS.values():
        world.stop()


if __name__ == "__main__":
    _worker()
