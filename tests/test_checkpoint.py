"""Checkpoints: kill -9 and resume bitwise, resharding into other layouts, atomic saves, keep_last, async = sync,
the preemption signal path, non-finite step skipping, and clear errors. Real processes, real files, real signals."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, loss_curve, metrics_rows, run_cli, step_rows, user_env
from hybridpar.checkpoint.dcp import CheckpointError, load_full_model_state, read_trainer_state
from hybridpar.data.record import of_tensor
from hybridpar.checkpoint.layout import (checkpoint_dir, is_complete, latest_checkpoint, list_checkpoints,
                                        resolve_load_path, step_of)

STEPS = 8
COMMON = ["--train.steps", str(STEPS), "--train.global_batch_size", "8", "--train.seq_len", "64",
          "--logging.interval", "1", "--train.eval_interval", "0", "--train.sample_tokens", "0",
          "--train.precision", "fp32", "--checkpoint.interval", "2", "--checkpoint.keep_last", "3",
          "--logging.wandb.mode", "disabled"]


def _args(cache_dir, run_dir, *extra):
    return ["launch/pretrain_gpt.py", *COMMON, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("ckpt") / "ref"
    out = run_cli(_args(cache_dir, run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir / "stdout.txt").write_text(out.stdout)
    losses = loss_curve(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return run_dir, losses, load_full_model_state(checkpoint_dir(run_dir, STEPS))


def _kill_when(run_dir, cache_dir, ready, delay: float = 0.0, extra=()):
    """Start the run, SIGKILL it once ready(run_dir) holds (plus delay); returns whether it was still running."""
    with open(run_dir.parent / "killed.log", "w") as log:  # its console, kept for a failure's message
        proc = subprocess.Popen([sys.executable, *_args(cache_dir, run_dir, *extra)], cwd=ROOT, env=user_env(),
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while not ready(run_dir) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return alive


def _head(path, lines: int = 8) -> str:
    return "\n".join(path.read_text().splitlines()[:lines])


def _saving(step):
    """A save of `step` has started but is not complete."""
    return lambda d: checkpoint_dir(d, step).exists() and not (checkpoint_dir(d, step) / "COMPLETE").exists()


def _complete(step):
    return lambda d: (checkpoint_dir(d, step) / "COMPLETE").exists()


@pytest.mark.parametrize("kill_point", ["after-save-4", "during-save-6", "random-after-4"])
def test_kill_9_and_resume_is_bitwise_exact(kill_point, reference, tmp_path, cache_dir):
    _, ref_losses, ref_weights = reference
    run_dir = tmp_path / "run"
    ready = {"after-save-4": _complete(4), "during-save-6": _saving(6), "random-after-4": _complete(4)}[kill_point]
    delay = random.Random(kill_point).uniform(0.0, 1.5) if kill_point.startswith("random") else 0.0
    _kill_when(run_dir, cache_dir, ready, delay)
    resume_from = latest_checkpoint(run_dir)
    assert resume_from is not None and step_of(resume_from) >= 4
    out = run_cli(_args(cache_dir, run_dir))  # same command: resumes from the latest complete checkpoint
    assert out.returncode == 0, out.stderr[-3000:]
    n = step_of(resume_from)
    assert f"resuming from {resume_from} (step {n}, {n * 8} samples; read in " in out.stdout  # global batch 8
    # The data position survives the resume: the final checkpoint has consumed steps x global batch samples.
    state = read_trainer_state(checkpoint_dir(run_dir, STEPS))
    history = state.pop("spike_history")  # the spike test's window (train.spike warn): each step's loss and norm
    # The data record: the resume read what the first start read, so it holds that start alone (hybridpar.data.record).
    record = of_tensor(state.pop("data_record"), "final checkpoint")
    assert [(s["from_step"], s["train_batches"], s["allowed_change"]) for s in record] == [(0, STEPS, False)]
    assert [s["config"]["run"]["dir"] for s in record] == [str(run_dir)]
    assert state == {"step": STEPS, "consumed_samples": STEPS * 8, "skipped": 0, "skip_streak": 0,
                     "skip_windows": [], "rewinds": 0, "lr_scale_until": 0,
                     "exact_bounds": []}  # (parallel.exact_reduction's grids: none outside the mode)
    assert [h[0] for h in history] == [reference[1][s] for s in range(1, STEPS + 1)]  # (float64 of the fp32 loss)
    assert "note:" not in out.stdout  # same thread count: no warning about an inexact resume
    ref_rows, rows = step_rows(reference[0]), step_rows(run_dir)
    # The same tokens in the same order at every step, before and after the kill (CRC-32 of each step's batch).
    assert {s: r["batch_crc32"] for s, r in rows.items()} == {s: r["batch_crc32"] for s, r in ref_rows.items()}
    got = loss_curve(run_dir)
    # Bitwise: every step, before and after the kill. On a failure, say which steps differ, with exact values and
    # gradient norms, and both processes' start-up lines (this test once failed in a review run at step 1 only, by
    # ~1e-6 relative, and never here since; `python benchmarks/determinism.py sensitivity` measures which
    # perturbations of step 1 move its loss that much).
    if got != ref_losses:
        diff = {s: {"loss": (got.get(s, float("nan")).hex(), ref_losses[s].hex()),
                    "grad_norm": (rows.get(s, {}).get("grad_norm"), ref_rows[s]["grad_norm"])}
                for s in ref_losses if got.get(s) != ref_losses[s]}
        pytest.fail(f"losses differ at steps {sorted(diff)} (resumed from step {n}): {diff}\n"
                    f"killed run:\n{_head(tmp_path / 'killed.log')}\nreference:\n{_head(reference[0] / 'stdout.txt')}")
    weights = load_full_model_state(checkpoint_dir(run_dir, STEPS))
    assert [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])] == []


def test_incomplete_saves_are_never_used(reference, tmp_path):
    ref_dir = reference[0]
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint_dir(ref_dir, 4), checkpoint_dir(run_dir, 4))
    partial = checkpoint_dir(run_dir, 6)
    shutil.copytree(checkpoint_dir(ref_dir, 6), partial)
    (partial / "COMPLETE").unlink()  # what a save cut off before its marker leaves
    assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, 4)
    assert resolve_load_path(str(run_dir)) == checkpoint_dir(run_dir, 4)
    with pytest.raises(CheckpointError, match="was not completed"):
        resolve_load_path(str(partial))


def test_a_step_dir_that_links_out_of_the_run_is_unlinked_never_followed(tmp_path):
    """A link under checkpoints/ is no save of the run: latest_checkpoint passes it by, and the cleanups (a cut-off
    save's, keep_last's, a rewind's) remove the link, not what it leads to (rmtree refused a link: every start
    failed on it)."""
    from hybridpar.checkpoint.layout import remove_step_dir

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "COMPLETE").write_text("step 4\n")  # (what a finished save's marker holds)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    link = checkpoint_dir(run_dir, 6)
    link.symlink_to(outside, target_is_directory=True)
    assert latest_checkpoint(run_dir) is None and is_complete(link)
    remove_step_dir(link)
    assert not link.exists() and not link.is_symlink() and (outside / "COMPLETE").exists()
    shutil.copytree(outside, checkpoint_dir(run_dir, 2))
    remove_step_dir(checkpoint_dir(run_dir, 2))
    remove_step_dir(checkpoint_dir(run_dir, 8))  # (absent: nothing to do)
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_resume_with_another_thread_count_says_it_is_not_bitwise(reference, tmp_path, cache_dir):
    """A CPU run's intra-op thread count sets the order of its parallel reductions, so a resume with another count
    continues the curve to rounding only: the checkpoint records the count and the resumed run says so."""
    ref_dir, ref_losses, _ = reference
    was = json.loads((checkpoint_dir(ref_dir, 4) / "run_state.json").read_text())["cpu_threads"]
    # OpenMP's default: OMP_NUM_THREADS, else the CPUs this process may run on (the reference inherited both).
    assert was == int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    other = 1 if was != 1 else 2
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint_dir(ref_dir, 4), checkpoint_dir(run_dir, 4))
    env = {**user_env(), "OMP_NUM_THREADS": str(other), "MKL_CBWR": "OFF"}  # and MKL's reproducible mode off
    out = run_cli(_args(cache_dir, run_dir), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "note: MKL_CBWR=OFF leaves MKL's matmuls free to round differently from one process to the next" in out.stdout
    assert (f"note: step_00000004 was written by a CPU run with {was} intra-op threads and this one has {other}: "
            f"the curve continues to rounding, not bitwise (OMP_NUM_THREADS={was} resumes it exactly)") in out.stdout
    got = loss_curve(run_dir)
    assert sorted(got) == list(range(5, STEPS + 1))
    assert all(abs(got[s] - ref_losses[s]) <= 1e-5 * ref_losses[s] for s in got), (got, ref_losses)


@pytest.mark.multiprocess
def test_importing_hybridpar_puts_mkl_in_its_reproducible_mode_before_its_first_call():
    """MKL reads MKL_CBWR and MKL_DYNAMIC at its first call: a fresh interpreter that imports hybridpar (not
    torch first) runs its first GEMM strict and without dynamic threads, as MKL itself reports; a user's value
    stays; without hybridpar, MKL's default (CNR:OFF, Dyn:1) is what a process gets."""
    if not torch.backends.mkl.is_available():
        pytest.fail("this torch is built without MKL: the CPU wheels CI installs have it")
    code = "import {}; import torch; a = torch.ones(64, 64); a @ a"
    env = {k: v for k, v in user_env().items() if not k.startswith("MKL_")}

    def first_gemm(module, **extra):
        out = subprocess.run([sys.executable, "-c", code.format(module)], env={**env, "MKL_VERBOSE": "1", **extra},
                             capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.splitlines() if "GEMM(" in x)
        return line.split("CNR:")[1].split()[0], line.split("Dyn:")[1].split()[0]

    assert first_gemm("hybridpar") == ("AUTO,STRICT", "0")
    assert first_gemm("hybridpar", MKL_CBWR="COMPATIBLE") == ("COMPATIBLE", "0")
    assert first_gemm("os") == ("OFF", "1")


def test_mkl_notes_at_start_name_the_mode_that_cannot_repeat():
    from hybridpar.parallel import cpu_blas_notes

    assert cpu_blas_notes(True, {"MKL_CBWR": "AUTO,STRICT"}) == cpu_blas_notes(True, {"MKL_CBWR": "avx2"}) == []
    for value, shown in (("OFF", "OFF"), (" off ", "off"), ("", "(empty)")):
        note, = cpu_blas_notes(True, {"MKL_CBWR": value})
        assert note.startswith(f"note: MKL_CBWR={shown} leaves") and note.endswith(
            "MKL_CBWR=AUTO,STRICT is hybridpar's reproducible default"), note
    assert cpu_blas_notes(True, {})[0].startswith("note: MKL_CBWR=unset leaves")
    assert "not MKL" in cpu_blas_notes(False, {"MKL_CBWR": "AUTO,STRICT"})[0]


def test_keep_last_keeps_the_newest_complete_checkpoints(reference):
    assert [p.name for p in list_checkpoints(reference[0])] == ["step_00000004", "step_00000006", "step_00000008"]


# (1, 1, 4) also resumes with the fused AdamW (CUDA's default): the kernel is the resuming run's, not the saved
# for-loop's, and its param groups (one per parameter role) are the same on every layout.
@pytest.mark.parametrize("layout", [("1", "4", "1"), ("1", "1", "4", "--optim.fused", "true")],
                         ids=["r1s4t1", "r1s1t4-fused"])
def test_resume_into_another_layout_continues_the_curve(layout, tmp_path, cache_dir, tmp_path_factory):
    src = tmp_path_factory.getbasetemp() / "reshard-src"
    if not (src / "metrics.jsonl").exists():  # saved once by the (1,2,2) layout on 4 ranks
        out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                       *_args(cache_dir, src, "--parallel.dp_shard", "2", "--parallel.tp", "2")])
        assert out.returncode == 0, out.stderr[-3000:]
    src_losses = loss_curve(src)
    r, s, t, *extra = layout
    run_dir = tmp_path / "resharded"
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   *_args(cache_dir, run_dir, "--checkpoint.load", str(checkpoint_dir(src, 4)),
                          "--parallel.dp_replicate", r, "--parallel.dp_shard", s, "--parallel.tp", t, *extra)])
    assert out.returncode == 0, out.stderr[-3000:]
    got = loss_curve(run_dir)
    assert sorted(got) == list(range(5, STEPS + 1))
    for step in got:
        assert abs(got[step] - src_losses[step]) <= 1e-5 * abs(src_losses[step]), (got, src_losses)


def test_async_save_equals_sync_save(reference, tmp_path, cache_dir):
    run_dir = tmp_path / "async"
    out = run_cli(_args(cache_dir, run_dir, "--checkpoint.async_save", "true"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "started checkpoint" in out.stdout and "step loop blocked" in out.stdout
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000004", "step_00000006", "step_00000008"]
    ref_dir, ref_losses, _ = reference
    assert loss_curve(run_dir) == ref_losses
    for step in (4, 8):
        a, b = (load_full_model_state(checkpoint_dir(d, step)) for d in (run_dir, ref_dir))
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_sigterm_saves_exits_75_and_resumes_exactly(reference, tmp_path, cache_dir):
    run_dir = tmp_path / "preempted"
    proc = subprocess.Popen([sys.executable, *_args(cache_dir, run_dir, "--checkpoint.interval", "100")], cwd=ROOT,
                            env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and '"step": 3' in (run_dir / "metrics.jsonl").read_text():
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    assert "signal SIGTERM: stopping after this step" in stderr
    saved = latest_checkpoint(run_dir)
    stopped_at = step_of(saved)
    assert 3 <= stopped_at < STEPS and f"saved checkpoint {saved}" in stdout
    out = run_cli(_args(cache_dir, run_dir, "--checkpoint.interval", "100"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert loss_curve(run_dir) == reference[1]



@pytest.mark.parametrize("at", [0, 4])
def test_sigterm_during_a_long_validation_stops_it_and_saves(at, tmp_path, cache_dir):
    """A signal while a validation runs (150 batches: the start's, or step 4's) stops it at the next batch: nothing
    of it is logged, no further step runs, the step's checkpoint is saved, the exit status is the preemption's.
    Before, the whole validation ran (and then a step, after the start's)."""
    run_dir = tmp_path / "val"
    args = _args(cache_dir, run_dir, "--checkpoint.interval", "100", "--train.eval_interval", "4",
                 "--train.eval_batches", "150", "--logging.interval", "4")
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # opened before the start's validation; step 4's
        if metrics.exists() and (at == 0 or '"step": 4, "loss"' in metrics.read_text()):  # row just before its own
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 75, stderr[-3000:]
    assert f"validation at step {at} stopped by a stop request; not logged" in stdout
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows if "val_loss" in r] == ([] if at == 0 else [0])
    assert max([r["step"] for r in rows if "loss" in r], default=0) == at
    assert latest_checkpoint(run_dir) == checkpoint_dir(run_dir, at)

def test_second_signal_aborts_and_keeps_the_last_checkpoint(tmp_path, cache_dir):
    run_dir = tmp_path / "twice"
    proc = subprocess.Popen([sys.executable, *_args(cache_dir, run_dir)], cwd=ROOT, env=user_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (checkpoint_dir(run_dir, 2) / "COMPLETE").exists():
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 76, stderr[-3000:]
    assert "signal SIGTERM again: aborting" in stderr
    assert latest_checkpoint(run_dir) is not None  # what was complete stays complete and loadable
    load_full_model_state(latest_checkpoint(run_dir))


# Muon with the fused AdamW beside it (CUDA's default) skips on the device: the optimizer reads found_inf.
@pytest.mark.parametrize("optim", [[], ["--optim.name", "muon", "--optim.fused", "true"]], ids=["adamw", "muon-fused"])
def test_non_finite_steps_are_skipped_then_stop_the_run(optim, tmp_path, cache_dir):
    # the weights x 1e30 after step 1's backward (tests/fault_drill.py: what a learning rate of 1e30 did before the
    # config refused one), so step 1's update leaves weights that overflow every later forward
    out = run_cli(["tests/fault_drill.py", "0", "1", "w1e30",
                   *_args(cache_dir, tmp_path / "nan", *optim, "--optim.warmup_steps", "0",
                          "--train.max_skipped_steps", "2", "--checkpoint.interval", "1")[1:]])
    assert out.returncode == 3, out.stderr[-3000:]
    assert "optimizer step skipped (1 in a row" in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("error: 3 non-finite steps in a row")
    # Step 1 is finite (its update of the broken weights is what overflows): its checkpoint is the last good one,
    # and nothing was saved inside the streak that followed.
    assert latest_checkpoint(tmp_path / "nan") == checkpoint_dir(tmp_path / "nan", 1)
    assert "not saving a checkpoint at step 2: 1 non-finite step(s) in a row" in out.stdout


def test_checkpoint_of_another_model_fails_clearly(reference, tmp_path, cache_dir):
    out = run_cli(_args(cache_dir, tmp_path / "other", "--checkpoint.load", str(checkpoint_dir(reference[0], 4)),
                        "--model.n_layers", "2"))
    assert out.returncode == 2 and "holds a different model (n_layers: checkpoint 4 vs now 2)" in out.stderr
    assert not (tmp_path / "other").exists()


def test_resume_checks_hold_without_the_checkpoints_config_yaml(reference, tmp_path, cache_dir):
    """config.yaml is a convenience copy: without it, other data settings are still refused (the DCP checkpoint
    carries their key) and another model still fails on the first tensor whose shape differs. Both were silent
    (another seed resumed at exit 0)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(reference[0], 4), ckpt)
    (ckpt / "config.yaml").unlink()
    out = run_cli(_args(cache_dir, tmp_path / "seed", "--checkpoint.load", str(ckpt), "--train.seed", "7"))
    assert out.returncode == 2 and "with other data settings (one of train.seed, train.seq_len" in out.stderr, \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr and not (tmp_path / "seed").exists()
    out = run_cli(_args(cache_dir, tmp_path / "shape", "--checkpoint.load", str(ckpt), "--model.d_model", "64",
                        "--model.n_heads", "2"))
    assert out.returncode == 2 and "holds a different model: model." in out.stderr and "has shape" in out.stderr, \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_weights_only_starts_a_new_run(reference, tmp_path, cache_dir):
    out = run_cli(_args(cache_dir, tmp_path / "ft", "--checkpoint.load", str(reference[0]),
                        "--checkpoint.load_weights_only", "true", "--train.steps", "2"))
    assert out.returncode == 0, out.stderr[-3000:]
    losses = loss_curve(tmp_path / "ft")
    assert sorted(losses) == [1, 2]
    assert losses[1] < reference[1][1] - 0.2  # starts from trained weights, not from the initialisation


pytestmark = pytest.mark.multiprocess  # every test here starts processes


# -- Muon: its momentum buffers are checkpointed, resharded and restored like AdamW's moments ---------------------
MUON = ["--optim.name", "muon"]


@pytest.fixture(scope="module")
def muon_reference(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("muon") / "ref"
    out = run_cli(_args(cache_dir, run_dir, *MUON))
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, loss_curve(run_dir), load_full_model_state(checkpoint_dir(run_dir, STEPS))


def test_muon_kill_9_and_resume_is_bitwise_exact(muon_reference, tmp_path, cache_dir):
    ref_dir, ref_losses, ref_weights = muon_reference
    run_dir = tmp_path / "run"
    _kill_when(run_dir, cache_dir, _complete(4), extra=MUON)
    resume_from = latest_checkpoint(run_dir)
    out = run_cli(_args(cache_dir, run_dir, *MUON))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from {resume_from} (step {step_of(resume_from)}" in out.stdout
    assert loss_curve(run_dir) == ref_losses
    weights = load_full_model_state(checkpoint_dir(run_dir, STEPS))
    assert [k for k in ref_weights if not torch.equal(weights[k], ref_weights[k])] == []


def test_muon_resumes_into_another_layout(muon_reference, tmp_path, cache_dir):
    """One process's step-4 Muon checkpoint continued on 4 ranks with TP and FSDP: the curve continues."""
    ref_dir, ref_losses, _ = muon_reference
    run_dir = tmp_path / "resharded"
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   *_args(cache_dir, run_dir, *MUON, "--checkpoint.load", str(checkpoint_dir(ref_dir, 4)),
                          "--parallel.dp_shard", "2", "--parallel.tp", "2")])
    assert out.returncode == 0, out.stderr[-3000:]
    got = loss_curve(run_dir)
    assert sorted(got) == list(range(5, STEPS + 1))
    for step in got:
        assert abs(got[step] - ref_losses[step]) <= 1e-5 * ref_losses[step], (got, ref_losses)


def test_muon_starts_from_a_seed_checkpoint_and_refuses_adamw_state(muon_reference, reference, tmp_path, cache_dir):
    seed_dir = tmp_path / "seed"
    out = run_cli(_args(cache_dir, seed_dir, *MUON, "--train.steps", "0", "--checkpoint.interval", "1"))
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "from-seed"
    out = run_cli(_args(cache_dir, run_dir, *MUON, "--checkpoint.load", str(checkpoint_dir(seed_dir, 0))))
    assert out.returncode == 0, out.stderr[-3000:]
    assert loss_curve(run_dir) == muon_reference[1]  # the seed is the init: a fresh Muon from it is the same run
    ckpt = checkpoint_dir(reference[0], 4)  # AdamW's
    out = run_cli(_args(cache_dir, tmp_path / "mixed", *MUON, "--checkpoint.load", str(ckpt)))
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == (
        f"error: {ckpt} holds adamw optimizer state and this run has optim.name=muon; resume with --optim.name "
        f"adamw, or start from its weights with --checkpoint.load_weights_only true")
    assert not (tmp_path / "mixed").exists()


# Written out by hand (not read from DATA_FIELDS): what the consumed-samples position means. Changing any of them
# on a resume indexes other samples, so each must be named and refused; the others must not be.
DATA_DEFINING = [("train.seed", "99"), ("train.seq_len", "64"), ("data.path", "/data/other"),
                 ("data.split", "90,10,0"), ("data.tokenizer", "bytes"), ("data.stages", "0: builtin")]
NOT_DATA_DEFINING = [("train.global_batch_size", "64"), ("data.source_exhausted", "stop"), ("train.steps", "7"),
                     ("data.cache_dir", "/elsewhere"), ("optim.lr", "0.001")]


@pytest.mark.parametrize("field, value", DATA_DEFINING + NOT_DATA_DEFINING, ids=[f for f, _ in DATA_DEFINING +
                                                                                   NOT_DATA_DEFINING])
def test_each_data_defining_field_changed_on_resume_is_named(field, value, tmp_path):
    import yaml

    from hybridpar.checkpoint.resume_checks import data_changes, data_key
    from hybridpar.config.cli import load_config, to_dict

    saved = load_config([])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(saved)))
    now = load_config([f"--{field}", value])
    changes = data_changes(tmp_path, now, None)
    if (field, value) in DATA_DEFINING:
        assert [c.split(":")[0] for c in changes] == [field], changes
        assert data_key(now) != data_key(saved)
    else:
        assert changes == [] and data_key(now) == data_key(saved), changes
