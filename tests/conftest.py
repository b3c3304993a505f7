"""Shared fixtures. Tests run on CPU; a session-wide cache directory keeps the built-in corpus and its tokenizer
from being rebuilt by every end-to-end test while leaving the user's ~/.cache alone.

Two tiers: tests marked `multiprocess` start processes (the launchers, gloo ranks, torchrun, the SLURM cluster);
`python -m pytest -q -m "not multiprocess"` runs the rest, the unit tier. A unit test that starts a process fails
(the guard below), so the tier stays what its name says."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import multiprocessing.process

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _no_process_started(item):
    """Around an unmarked test's set-up (its fixtures of every scope included) and call: starting a process fails."""
    if item.get_closest_marker("multiprocess"):
        yield
        return

    def refuse(*_a, **_k):
        raise AssertionError(f"{item.nodeid} starts a process: mark it @pytest.mark.multiprocess")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _no_process_started(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _no_process_started(item):
        return (yield)


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
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a launch/ script as a user would, in a fresh interpreter (env: the environment, default this one's)."""
    return subprocess.run([sys.executable, *args], cwd=cwd or ROOT, env=user_env(env), capture_output=True, text=True,
                          timeout=timeout)


def launcher(name: str):
    """launch/<name>.py as a module, loaded by its path (launch/evaluate.py is not Hugging Face's `evaluate`), for
    calling its cli() in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"launch_{name}", ROOT / "launch" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up while they are built)
    spec.loader.exec_module(module)
    return module


def user_env(env: dict | None = None) -> dict:
    """`env` (default this process's environment) without torchrun's rank variables, as a user's shell has it."""
    return {k: v for k, v in (env or os.environ).items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every row of <run_dir>/metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_rows(run_dir: Path) -> dict[int, dict]:
    """The last training row of each step (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: r for r in metrics_rows(run_dir) if "loss" in r}


def loss_curve(run_dir: Path) -> dict[int, float]:
    """Each step's training loss, from step_rows()."""
    return {s: r["loss"] for s, r in step_rows(run_dir).items()}
