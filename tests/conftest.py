"""Shared fixtures. Tests run on CPU; a session-wide cache directory keeps the built-in corpus and its tokenizer
from being rebuilt by every end-to-end test while leaving the user's ~/.cache alone.

Two tiers: tests marked `multiprocess` start processes (the launchers, gloo ranks, torchrun, the SLURM cluster);
`python -m pytest -q -m "not multiprocess"` runs the rest, the unit tier. A unit test that starts a process fails
(the guard below), so the tier stays what its name says."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import multiprocessing.process

import pytest

from warm import user_env  # noqa: F401  (the tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
_HF_HOME: list[str] = []


def pytest_configure(config):
    """Tests never reach the network, and Hugging Face's caches (datasets' prepared JSON tasks) stay out of the
    user's home: set in the pytest process (not in the warm workers that import this module) before any library, or
    a warm world's worker, reads them; removed at the end of the session."""
    _HF_HOME.append(tempfile.mkdtemp(prefix="hybridpar-tests-hf-"))
    os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=_HF_HOME[0])
    # Every Python interpreter started under the session (a warm worker, torchrun's agent and ranks, a shell script's,
    # a SLURM job's) writes a line to one file as it starts, through a sitecustomize on PYTHONPATH: the suite's
    # starts are counted, not inferred from command lines.
    hook = Path(_HF_HOME[0]) / "count-starts"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "try:\n"
        "    with open(os.environ['HYBRIDPAR_TEST_STARTS'], 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "except Exception:  # a start is counted where the file can be reached; it is never stopped\n"
        "    pass\n")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(hook)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ["HYBRIDPAR_TEST_STARTS"] = str(hook / "starts.log")


_RUNNING: dict = {}  # the test being set up or run: its id and whether it is marked multiprocess


@contextlib.contextmanager
def _no_process_started(item):
    """Around an unmarked test's set-up (its fixtures of every scope included) and call: starting a process fails."""
    _RUNNING.update(nodeid=item.nodeid, multiprocess=item.get_closest_marker("multiprocess") is not None)
    if item.get_closest_marker("multiprocess"):
        yield
        return

    def refuse(*_a, **_k):
        raise AssertionError(f"{item.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield


# -- what the suite costs: interpreter starts per test, and one line at the end ------------------------------------
STARTS: dict[str, int] = {}  # test id -> Python interpreters its set-up and call started
SECONDS: dict[str, float] = {}  # test id -> wall seconds of set-up, call and teardown
_SESSION_START = time.perf_counter()


def _starts_so_far() -> int:
    """Python interpreters started under this session so far (pytest_configure's sitecustomize)."""
    try:
        return Path(os.environ["HYBRIDPAR_TEST_STARTS"]).read_bytes().count(b"\n")
    except (KeyError, FileNotFoundError):
        return 0


@contextlib.contextmanager
def _count_starts(item):
    """Counts the interpreters a test's set-up or call starts (its children's children included)."""
    before = _starts_so_far()
    try:
        yield
    finally:
        STARTS[item.nodeid] = STARTS.get(item.nodeid, 0) + _starts_so_far() - before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_process_started(item), _count_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_process_started(item), _count_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A test file that leaves a process group behind fails at its last test, not the next test to make one (a
    module-scoped group lives until then)."""
    result = yield
    dist = sys.modules.get("torch.distributed")
    last_of_file = nextitem is None or nextitem.path != item.path
    if last_of_file and dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail(f"{item.path.name} left a torch.distributed process group behind: destroy it where it is made")
    return result


def pytest_runtest_logreport(report):
    SECONDS[report.nodeid] = SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """One line: the tiers, the wall time, the interpreter starts; with HYBRIDPAR_COST_REPORT=FILE, per test file
    (seconds, starts, tests) and per test (seconds, starts) as JSON there."""
    unit = [n for n in SECONDS if n not in _MULTIPROCESS]
    wall = time.perf_counter() - _SESSION_START
    terminalreporter.write_line(
        f"hybridpar suite cost: {len(unit)} unit + {len(SECONDS) - len(unit)} multiprocess tests, wall {wall:.0f} s "
        f"(unit {sum(SECONDS[n] for n in unit):.0f} s), {sum(STARTS.values())} interpreter starts")
    out = os.environ.get("HYBRIDPAR_COST_REPORT")
    if out:
        files: dict[str, list] = {}
        for nodeid, seconds in SECONDS.items():
            f = files.setdefault(nodeid.split("::")[0], [0.0, 0, 0])
            f[0] += seconds
            f[1] += STARTS.get(nodeid, 0)
            f[2] += 1
        tests = {n: [round(seconds, 2), STARTS.get(n, 0)] for n, seconds in SECONDS.items()}
        Path(out).write_text(json.dumps({"files": files, "tests": tests}, indent=1) + "\n")


_MULTIPROCESS: set[str] = set()


def pytest_collection_modifyitems(items):
    _MULTIPROCESS.update(i.nodeid for i in items if i.get_closest_marker("multiprocess"))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybridpar-cache")


@pytest.fixture
def one_process_group(tmp_path_factory):
    """A real world-size-1 gloo group for this test, as hybridpar's launcher makes even for one process (megatron-core
    asks torch.distributed for the rank; a mesh needs a group)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 600,
            env: dict | None = None, warm: bool = True) -> subprocess.CompletedProcess:
    """Run a launch/ script as a user would (env: the environment, default this one's): `launch/X.py ...` and
    `-m torch.distributed.run --standalone --nproc_per_node=N launch/X.py ...` in a warm world (tests/warm.py), in
    cwd (default the project root), when the test leaves env alone; anything else, or warm=False (the process is
    what is tested), or HYBRIDPAR_COLD=1 in the environment, in a fresh interpreter."""
    from warm import run_warm, warm_command

    command = warm_command(args) if warm and env is None and not os.environ.get("HYBRIDPAR_COLD") else None
    if command is not None:
        if not _RUNNING.get("multiprocess"):
            raise AssertionError(f"{_RUNNING.get('nodeid')} runs a launcher: mark it @pytest.mark.multiprocess")
        return run_warm(*command, user_env(), timeout, cwd or ROOT)
    return subprocess.run([sys.executable, *args], cwd=cwd or ROOT, env=user_env(env), capture_output=True, text=True,
                          timeout=timeout)


def pytest_sessionfinish(session):
    from warm import stop_all

    stop_all()
    for path in _HF_HOME:
        shutil.rmtree(path, ignore_errors=True)


def launcher(name: str):
    """launch/<name>.py as a module, loaded by its path (launch/evaluate.py is not Hugging Face's `evaluate`), for
    calling its cli() in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up while they are built)
    spec.loader.exec_module(module)
    return module


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_job(agent: subprocess.Popen, timeout: float = 30) -> list[int]:
    """SIGKILL a torchrun agent and its workers at once, as a node failure would, and wait until none runs. torchrun
    starts each worker in a session of its own, so killing the agent's process group leaves them running (for up to
    half a second, until they see the agent gone): a restart started at once would find the run dir still held.
    Returns the workers' pids."""
    workers = children(agent.pid)
    for pid in [agent.pid, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()
    deadline = time.time() + timeout
    while any(map(running, workers)) and time.time() < deadline:
        time.sleep(0.02)
    assert not any(map(running, workers)), f"workers {workers} still run {timeout}s after SIGKILL"
    return workers


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every row of <run_dir>/metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir: Path) -> dict[int, dict]:
    """The last training row of each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r for r in metrics_rows(run_dir) if "loss" in r}


def loss_curve(run_dir: Path) -> dict[int, float]:
    """Each step's training loss, from step_rows()."""
    return {s: r["loss"] for s, r in step_rows(run_dir).items()}
