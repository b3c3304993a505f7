"""The benchmark harness on CPU: the JSON it writes, with the plain-loop baseline and the ratio."""

from __future__ import annotations

import json
import time

import pytest
from conftest import run_cli


def test_benchmark_json_with_plain_baseline(tmp_path, cache_dir):
    start = time.perf_counter()
    out = run_cli(["launch/benchmark.py", "--warmup", "1", "--steps", "2", "--baseline", "plain", "--json",
                   str(tmp_path / "b.json"), "--train.seq_len", "64", "--train.global_batch_size", "8",
                   "--data.cache_dir", str(cache_dir)])
    wall = time.perf_counter() - start
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads((tmp_path / "b.json").read_text())
    for key in ("tokens_per_sec", "step_time_s", "tflops_per_device", "baseline_tokens_per_sec", "ratio"):
        assert r[key] > 0, key
    assert r["mfu"] is None and r["peak_mem_bytes"] is None  # CPU: no known peak, no CUDA memory counter
    # Against the clock outside the process: both timed loops (1 + 2 steps each) ran inside its wall time; and
    # the tokens of a step are the batch asked for, 8 x 64.
    assert 2 * r["step_time_s"] + 2 * 8 * 64 / r["baseline_tokens_per_sec"] < wall
    assert abs(r["tokens_per_sec"] * r["step_time_s"] - 8 * 64) < 1e-6 * 8 * 64
    split = r["split"]
    assert split["forward_backward_s"] > 0 and split["optimizer_s"] > 0 and split["data_s"] >= 0
    assert not list(tmp_path.glob("runs*"))


def test_benchmark_bad_arguments_are_one_line():
    out = run_cli(["launch/benchmark.py", "--steps", "0"])
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "error: --warmup 3 --steps 0: need warmup >= 0 and steps >= 1"]


pytestmark = pytest.mark.multiprocess  # every test here starts processes
