"""The prepared GPU check (benchmarks/h200_check.sh) in its smoke mode: the same script and checks on the CPU with
the tiny models, so it is known to run to the end before a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, user_env


def test_gpu_check_runs_every_step_in_smoke_mode(tmp_path, cache_dir):
    out = tmp_path / "out"
    env = {**user_env(), "SMOKE": "1", "OUT": str(out), "HYBRIDPAR_CACHE": str(cache_dir), "PYTHON": sys.executable}
    r = subprocess.run(["bash", "benchmarks/h200_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "log.txt").read_text()
    assert "exit" not in log, log  # no step failed or timed out
    checks = {name: json.loads((out / f"{name}.json").read_text())
              for name in ("syncs", "bitwise", "bitwise_det", "attention", "compile")}
    for name, c in checks.items():
        assert c["ok"], (name, c)
    assert checks["syncs"]["fused_adamw"] and checks["syncs"]["syncs"] == 0
    assert checks["bitwise_det"]["deterministic"] and not checks["bitwise"]["deterministic"]
    assert checks["attention"]["kv_heads"] < checks["attention"]["n_heads"]  # the grouped-query case
    # validation and the end-of-run sample run the compiled blocks eagerly: no graph beyond the training one
    assert checks["compile"]["graphs_after_first_step"] == checks["compile"]["graphs_after_eval_and_sample"] >= 1
    bench = {name: json.loads((out / f"{name}.json").read_text())
             for name in ("bench_1.3b", "accum_true", "accum_false", "bench_6.7b")}
    assert bench["bench_1.3b"]["baseline_tokens_per_sec"] > 0 and bench["bench_1.3b"]["microbatches"] == 1
    assert bench["accum_true"]["accumulate_unsharded"] is True and bench["accum_false"]["accumulate_unsharded"] is False
    assert bench["accum_true"]["microbatches"] == bench["accum_false"]["microbatches"] == 2
    # holding the gathered bf16 model and fp32 gradients costs 6 bytes per parameter more than sharded accumulation
    params = bench["accum_true"]["planned_bytes"] - bench["accum_false"]["planned_bytes"]
    assert params > 0 and params % 6 == 0
    assert (out / "summary.txt").read_text().count(": ok ") == 5
    # fp8 (emulated here): both recipes ran the benchmark, and the gate ran its three runs from one seed checkpoint
    for recipe in ("tensorwise", "rowwise"):
        assert json.loads((out / f"fp8_{recipe}.json").read_text())["tokens_per_sec"] > 0
    gate = json.loads((out / "fp8_gate.json").read_text())
    assert gate["steps"] == 3 and sorted(gate["final"]) == ["baseline", "rowwise", "tensorwise"]
    assert "fp8_gate (3 steps): passed" in (out / "summary.txt").read_text()


pytestmark = pytest.mark.multiprocess  # every test here starts processes
