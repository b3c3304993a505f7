"""Observability: the offline W&B run read back from its .wandb file equals metrics.jsonl, resume continues the same
W&B run, disabled writes nothing, the API key appears nowhere; FLOPs/MFU formulas by hand; profiler trace; plots;
TensorBoard."""

from __future__ import annotations

import os

import pytest

from conftest import metrics_rows, run_cli
from hybridpar.planning.flops import flops_per_token, matmul_params, peak_tflops
from hybridpar.models import get_model_config
from wandb_file import history, run_id

FAKE_KEY = "hybridpar-test-key-0123456789abcdef0123"
ARGS = ["--train.steps", "6", "--train.global_batch_size", "8", "--train.seq_len", "64", "--logging.interval", "2",
        "--train.eval_interval", "3", "--train.sample_tokens", "0", "--checkpoint.interval", "3"]


def _wandb_files(run_dir):
    """The run files under wandb/offline-run-*/ (not through wandb's latest-run symlink)."""
    return sorted(p for p in run_dir.rglob("run-*.wandb") if not p.parent.is_symlink())


def _env_with_key():
    return {**os.environ, "WANDB_API_KEY": FAKE_KEY}


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("wandb") / "run"
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir),
                   "--logging.wandb.mode", "offline"], env=_env_with_key())
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, out


def test_offline_wandb_history_equals_metrics_jsonl(offline_run):
    run_dir, _ = offline_run
    files = _wandb_files(run_dir)
    assert len(files) == 1
    logged = {}
    for row in history(files[0]):
        logged.setdefault(row["_step"], {}).update({k: v for k, v in row.items() if k != "_step"})
    expected = {}
    for row in metrics_rows(run_dir):  # all but the step and batch_crc32, an identifier kept out of W&B
        expected.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k not in ("step", "batch_crc32")})
    assert sorted(logged) == sorted(expected) == [0, 2, 3, 4, 6]
    assert not any("batch_crc32" in values for values in logged.values())
    assert {"eval/next-words/acc", "eval/next-words/acc_norm"} <= set(logged[0]) & set(logged[6])  # tasks
    for step, values in expected.items():
        for key, value in values.items():
            assert logged[step][key] == pytest.approx(value, rel=1e-12), (step, key)


def test_training_rows_carry_every_metric(offline_run):
    run_dir, out = offline_run
    train = [r for r in metrics_rows(run_dir) if "loss" in r]
    for r in train:
        assert {"loss", "lr", "grad_norm", "tokens_per_sec", "tokens_per_sec_per_device", "tflops_per_device",
                "step_time", "data_time", "consumed_tokens", "skipped_steps", "step_time_max",
                "step_time_min", "batch_crc32"} <= set(r)
        assert 0 <= r["batch_crc32"] < 2 ** 32
        assert "mfu" not in r  # a CPU has no known peak: no MFU rather than a guessed one
        assert 0.0 <= r["data_time"] <= 1.0 and r["step_time_min"] <= r["step_time_max"]
        cfg = get_model_config("tiny")
        assert r["tflops_per_device"] == pytest.approx(flops_per_token(cfg, 64) * r["tokens_per_sec_per_device"] / 1e12)
    assert len({r["batch_crc32"] for r in train}) == len(train)  # each step trains on other tokens


def test_resume_continues_the_same_wandb_run(offline_run, tmp_path, cache_dir):
    import shutil

    run_dir, _ = offline_run
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")  # as if killed after step 3's checkpoint
    before = _wandb_files(resumed)
    first_id = run_id(before[0])
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(resumed),
                   "--logging.wandb.mode", "offline"])
    assert out.returncode == 0, out.stderr[-3000:]
    new = [f for f in _wandb_files(resumed) if f not in before]
    assert len(new) == 1 and run_id(new[0]) == first_id
    assert "resuming from" in out.stdout and f"W&B offline run {first_id}" in out.stdout
    steps = sorted({row["_step"] for row in history(new[0])})
    assert steps == [4, 6]  # continues at the resumed steps, never from 0


def test_disabled_writes_no_wandb_files(tmp_path, cache_dir):
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir",
                   str(tmp_path / "run"), "--logging.wandb.mode", "disabled"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert not list((tmp_path / "run").rglob("*wandb*"))



def test_wandb_mode_from_the_environment(monkeypatch):
    from hybridpar.errors import ConfigError
    from hybridpar.metrics import wandb_mode

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert wandb_mode(None) == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the environment's choice beats the key's default
    assert wandb_mode(None) == "offline" and wandb_mode("online") == "online"
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert wandb_mode(None) == "offline"
    for bad in ("", "bogus", "Offline"):
        monkeypatch.setenv("WANDB_MODE", bad)
        with pytest.raises(ConfigError, match=f"WANDB_MODE={bad!r} in the environment is not a W&B mode"):
            wandb_mode("offline")
        assert wandb_mode("disabled") == "disabled"  # wandb is never started


@pytest.mark.multiprocess
def test_an_empty_wandb_mode_is_one_line_and_writes_nothing(tmp_path, cache_dir):
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir",
                   str(tmp_path / "run")], env={**os.environ, "WANDB_MODE": ""})
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: WANDB_MODE='' in the environment"), out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.multiprocess
def test_unreachable_wandb_with_a_key_logs_offline(tmp_path, cache_dir):
    """A key set and the W&B server not answering (a loopback port nothing listens on): one line, then offline."""
    import socket

    with socket.socket() as s:  # a free loopback port, closed again: connections to it are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**_env_with_key(), "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_INIT_TIMEOUT": "3"}
    run_dir = tmp_path / "run"
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--train.steps", "2", "--checkpoint.interval", "0",
                   "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "W&B unreachable (" in out.stdout and "logging offline instead" in out.stdout
    assert "W&B offline run" in out.stdout and len(_wandb_files(run_dir)) == 1
    assert FAKE_KEY not in out.stdout + out.stderr

def test_api_key_is_in_no_file_the_run_writes(offline_run):
    run_dir, out = offline_run
    assert FAKE_KEY not in out.stdout + out.stderr
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


def test_flops_per_token_by_hand():
    # gpt2-124m, T=1024. Per layer: Q,K,V,O 4 x 768^2 = 2,359,296; MLP 2 x 768 x 3072 = 4,718,592.
    # 12 layers: 84,934,656; LM head 50304 x 768 = 38,633,472; N = 123,568,128.
    # 6N = 741,408,768; attention 6 x 12 x 1024 x 768 = 56,623,104; total 798,031,872.
    gpt2 = get_model_config("gpt2-124m")
    assert matmul_params(gpt2) == 123_568_128
    assert flops_per_token(gpt2, 1024) == 798_031_872
    # gpt-modern-1b, T=4096: Q,O 2 x 2048^2 = 8,388,608; K,V (8 kv heads x 64) 2 x 2048 x 512 = 2,097,152;
    # SwiGLU 3 x 2048 x 8192 = 50,331,648; per layer 60,817,408; x16 = 973,078,528; LM head 32000 x 2048 =
    # 65,536,000; N = 1,038,614,528; 6N = 6,231,687,168; attention 6 x 16 x 4096 x 2048 = 805,306,368.
    modern = get_model_config("gpt-modern-1b")
    assert matmul_params(modern) == 1_038_614_528
    assert flops_per_token(modern, 4096) == 7_036_993_536


def test_peak_table_and_unknown_devices():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.4
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("NVIDIA B200") == 2250.0
    assert peak_tflops("NVIDIA GeForce GTX 1080") is None and peak_tflops(None) is None


def test_profiler_trace_plot_and_tensorboard(tmp_path, cache_dir):
    run_dir = tmp_path / "prof"
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir),
                   "--profile.steps", "2-3", "--logging.tensorboard", "true"])
    assert out.returncode == 0, out.stderr[-3000:]
    traces = list((run_dir / "profile").glob("*.json"))
    assert len(traces) == 1 and "traceEvents" in traces[0].read_text()[:2000]
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    plot = run_cli(["launch/plot_metrics.py", str(run_dir), "--out", str(tmp_path / "m.png")])
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.multiprocess  # every test here starts processes


def test_throughput_is_measured_against_the_clock(tmp_path, cache_dir, capsys, monkeypatch):
    """Each step sleeps 0.25 s (after its backward) and the log comes every 4 steps: every
    interval's rows account for at least 4 x 0.25 s, the step times of all rows add up to no more than the run's own
    wall clock (its "done: N steps in X s" line), and tokens/s x step time is one step's tokens (8 x 64). An
    interval's time counted as one step's (4 x the wall clock) or a step's as the interval's (under 0.25 s) breaks
    these."""
    import time

    import hybridpar.training.microbatch
    from conftest import launcher

    step = hybridpar.training.microbatch.forward_backward_no_pipelining
    monkeypatch.setattr(hybridpar.training.microbatch, "forward_backward_no_pipelining",
                        lambda *a, **k: (step(*a, **k), time.sleep(0.25))[0])
    run_dir = tmp_path / "run"
    argv = ["--train.steps", "12", "--train.global_batch_size", "8", "--train.seq_len", "64", "--logging.interval",
            "4", "--train.eval_interval", "4", "--train.sample_tokens", "0", "--logging.wandb.mode", "disabled",
            "--model.n_layers", "1", "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)]
    assert launcher("pretrain_gpt").cli(argv) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done: 12 steps in ")]
    wall = float(done[0].split(" in ")[1].rstrip("s"))
    rows = [r for r in metrics_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [4, 8, 12]
    for r in rows:
        assert r["step_time"] >= 0.25 and r["tokens_per_sec"] * r["step_time"] == pytest.approx(8 * 64)
    assert 12 * 0.25 <= sum(4 * r["step_time"] for r in rows) <= wall
