"""Shared fixtures. Tests run on CPU; a session-wide cache directory keeps the built-in corpus and its tokenizer
from being rebuilt by every end-to-end test while leaving the user's ~/.cache alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hybridpar-cache")


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a launch/ script as a user would, in a fresh interpreter (env: the environment, default this one's)."""
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    return subprocess.run([sys.executable, *args], cwd=cwd or ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
