"""The shipped sbatch script on a real SLURM cluster (tools/slurm_ci_setup.sh: slurmctld + 2 slurmd, each node in
its own network namespace): a 2-node x 2-process job, and a preempted job that requeues and resumes.

Where sbatch is not installed these tests skip; .ci/run starts the cluster and sets HYBRIDPAR_REQUIRE_SLURM=1, which
turns that skip into a failure."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, loss_curve, run_cli, user_env

ARGS = ["--train.steps", "6", "--train.global_batch_size", "16", "--train.seq_len", "64", "--logging.interval", "1",
        "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.precision", "fp32",
        "--logging.wandb.mode", "disabled"]


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None:
        if os.environ.get("HYBRIDPAR_REQUIRE_SLURM") == "1":
            pytest.fail("HYBRIDPAR_REQUIRE_SLURM=1 but sbatch is not on PATH: tools/slurm_ci_setup.sh up failed?")
        pytest.skip("no SLURM here (sbatch not on PATH); `bash tools/slurm_ci_setup.sh up` starts a local cluster")
    info = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0 and os.environ.get("HYBRIDPAR_REQUIRE_SLURM") != "1":
        # SLURM's client is installed but no controller answers (e.g. a machine where CI's cluster was torn down).
        pytest.skip(f"no SLURM controller answers ({info.stderr.strip()}); "
                    "`bash tools/slurm_ci_setup.sh up` starts one")
    assert info.returncode == 0, info.stderr
    return info.stdout


def _submit(tmp_path, name, args, nodes=2):
    env = {**user_env(), "NPROC_PER_NODE": "2", "HYBRIDPAR_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", f"--job-name={name}",
                          f"--output={tmp_path}/%x-%j.out", f"--error={tmp_path}/%x-%j.err", f"--chdir={ROOT}",
                          "launch/slurm/pretrain_gpt.sbatch", *args],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def _job(jid) -> dict:
    out = subprocess.run(["scontrol", "show", "job", jid], capture_output=True, text=True, timeout=60).stdout
    return dict(re.findall(r"(\w+)=(\S+)", out))


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


def _wait(jid, until, timeout=600, logs=None):
    """Poll `scontrol show job` until `until(job)`; a job that ended otherwise fails at once, with its state, reason
    and the tail of its output files (`logs`: their paths), instead of polling on to the timeout."""
    deadline = time.time() + timeout
    while True:
        job = _job(jid)
        if until(job):
            return job
        ended = job.get("JobState") in ENDED
        if ended or time.time() > deadline:
            if not ended:
                subprocess.run(["scancel", jid], timeout=60)
            tails = "".join(f"\n--- {f}:\n{f.read_text()[-2000:]}" for f in logs or () if f.exists())
            pytest.fail(f"job {jid} {'ended' if ended else f'did not get there in {timeout}s'}: JobState="
                        f"{job.get('JobState')} Reason={job.get('Reason')} Restarts={job.get('Restarts')} "
                        f"ExitCode={job.get('ExitCode')}{tails}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("slurm-ref") / "ref"
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    return loss_curve(run_dir)


def test_sbatch_two_nodes_hsdp_tp2_matches_one_process(slurm, reference, tmp_path, cache_dir):
    """The layout multi-node jobs use: TP inside a node, data-parallel replicas across nodes (2, 1, 2)."""
    run_dir = tmp_path / "run"
    t0 = time.time()
    jid = _submit(tmp_path, "hp-2node", [*ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir),
                                          "--parallel.tp", "2", "--parallel.dp_replicate", "2"])
    job = _wait(jid, lambda j: j.get("JobState") in ENDED)
    stdout = (tmp_path / f"hp-2node-{jid}.out").read_text()
    assert job["JobState"] == "COMPLETED", stdout[-3000:] + (tmp_path / f"hp-2node-{jid}.err").read_text()[-3000:]
    assert "4 rank(s) on 2 host(s)" in stdout and "'dp_replicate': 2, 'dp_shard': 1, 'cp': 1, 'tp': 2" in stdout
    got = loss_curve(run_dir)
    assert sorted(got) == sorted(reference)
    for step, want in reference.items():
        assert abs(got[step] - want) <= 1e-5 * abs(want), (got, reference)
    print(f"2-node sbatch job {jid}: {time.time() - t0:.0f}s from submit to COMPLETED")


def test_srun_without_torchrun_reads_slurm_variables(slurm, reference, tmp_path, cache_dir):
    """One srun task per process, no torchrun: rank/world from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, master
    address from the node list, port from the job id."""
    import shlex

    run_dir = tmp_path / "srun"
    args = [*ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir), "--parallel.tp", "2"]
    cmd = "srun --kill-on-bad-exit=1 " + shlex.join([sys.executable, "launch/pretrain_gpt.py", *args])
    env = {**user_env(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=2", "--job-name=hp-srun",
                          f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}", f"--wrap={cmd}"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    jid = out.stdout.strip().split(";")[0]
    job = _wait(jid, lambda j: j.get("JobState") in ENDED)
    stdout = (tmp_path / f"hp-srun-{jid}.out").read_text()
    assert job["JobState"] == "COMPLETED", stdout[-3000:]
    assert "4 rank(s) on 2 host(s)" in stdout and "'dp_shard': 2, 'cp': 1, 'tp': 2" in stdout
    got = loss_curve(run_dir)
    for step, want in reference.items():
        assert abs(got[step] - want) <= 1e-5 * abs(want), (got, reference)


def test_preempted_job_saves_requeues_and_resumes(slurm, tmp_path, cache_dir):
    args = [*ARGS, "--train.steps", "60", "--checkpoint.interval", "1000", "--data.cache_dir", str(cache_dir)]
    ref_dir = tmp_path / "unbroken"
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/pretrain_gpt.py",
                   *args, "--run.dir", str(ref_dir)])  # the same layout as the job: 2 processes
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "preempted"
    t0 = time.time()
    jid = _submit(tmp_path, "hp-preempt", [*args, "--run.dir", str(run_dir)], nodes=1)
    logs = [tmp_path / f"hp-preempt-{jid}.out", tmp_path / f"hp-preempt-{jid}.err"]
    metrics = run_dir / "metrics.jsonl"  # wait until it trains
    _wait(jid, lambda j: metrics.exists() and '"step": 3,' in metrics.read_text(), timeout=300, logs=logs)
    sig = subprocess.run(["scancel", "--signal=USR1", "--batch", jid], capture_output=True, text=True, timeout=60)
    assert sig.returncode == 0, sig.stderr
    _wait(jid, lambda j: int(j.get("Restarts", "0")) >= 1 and j.get("JobState") == "PENDING", timeout=300, logs=logs)
    seen = time.time()
    # SLURM holds a requeued job for cred_expire + 1 s (121 s by default, its BeginTime) because the requeue revoked
    # the job's launch credentials with a whole-second timestamp, and a node refuses every credential of that job made
    # in the same second or before ("Job credential revoked": the job FAILs without running). The requeue came before
    # `seen`, so once the clock is in the next second a new credential is newer: make the job eligible then.
    time.sleep(max(0.0, int(seen) + 1.05 - time.time()))
    upd = subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"], capture_output=True, text=True,
                         timeout=60)
    assert upd.returncode == 0, upd.stderr
    job = _wait(jid, lambda j: int(j.get("Restarts", "0")) >= 1 and j.get("JobState") == "COMPLETED", timeout=300,
                logs=logs)
    stdout = (tmp_path / f"hp-preempt-{jid}.out").read_text()
    assert "requeueing job" in stdout and "resuming from" in stdout, stdout[-3000:]
    assert loss_curve(run_dir) == loss_curve(ref_dir)  # bitwise, every step before and after the requeue
    print(f"preempted job {jid}: {time.time() - t0:.0f}s from submit to COMPLETED after {job['Restarts']} requeue(s)")


pytestmark = pytest.mark.multiprocess  # every test here starts processes
