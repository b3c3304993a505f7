"""After a hard kill: workers whose torchrun agent was SIGKILLed stop by themselves and say why (real torchrun, real
signals), and the same command then resumes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, children, run_cli, running, step_rows, user_env


@pytest.mark.multiprocess
def test_workers_stop_when_their_torchrun_agent_is_killed(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = ["launch/pretrain_gpt.py", "--train.steps", "2000", "--train.global_batch_size", "8", "--train.seq_len",
            "64", "--logging.interval", "1", "--train.eval_interval", "0", "--train.sample_tokens", "0",
            "--checkpoint.interval", "5", "--logging.wandb.mode", "disabled", "--data.cache_dir", str(cache_dir),
            "--run.dir", str(run_dir)]
    log = tmp_path / "console.txt"
    workers: list[int] = []
    with open(log, "w") as out:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                  *args], cwd=ROOT, env=user_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while (not (run_dir / "metrics.jsonl").exists() or len(step_rows(run_dir)) < 6) and time.time() < deadline:
            assert agent.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        workers = children(agent.pid)
        assert len(workers) == 2, workers
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        killed = time.time()
        while any(map(running, workers)) and time.time() < killed + 30:
            time.sleep(0.1)
        assert not any(map(running, workers)), f"workers {workers} still train {time.time() - killed:.0f}s after " \
                                                f"their agent was killed"
        size = (run_dir / "metrics.jsonl").stat().st_size
        time.sleep(1.0)
        assert (run_dir / "metrics.jsonl").stat().st_size == size  # nothing more written
        assert not (run_dir / ".lock").exists()  # released: the restart below may take the run dir
        console = log.read_text()
        for rank in (0, 1):
            assert f"rank {rank}: the torchrun agent (pid {agent.pid}) that started this worker is gone: exiting at " \
                   f"once" in console, console[-3000:]
    finally:
        for pid in workers:  # only if the test failed with them still running
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    # The same command, with fewer steps, resumes from the latest complete checkpoint.
    resumed = run_cli([*args[:2], "12", *args[3:]], env=dict(os.environ))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
