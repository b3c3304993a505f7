"""Loss spikes: the test against its window (by hand), the batch numbering past skipped windows (by enumeration),
and real runs on data with poisoned batches (tests/spike_data.py) and with an injected fault: a rewound run equals
a run resumed from the same checkpoint with the same batches skipped, bitwise; a rerun tells the data from a fault
and names the rank."""

from __future__ import annotations

import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from conftest import ROOT, loss_curve, metrics_rows, run_cli, step_rows, user_env
from hybridpar.checkpoint.dcp import load_full_model_state, read_trainer_state
from hybridpar.checkpoint.layout import checkpoint_dir, list_checkpoints, step_of
from hybridpar.config import Config, DataConfig, SpikeConfig, TrainConfig, merge_windows
from hybridpar.data.positions import batch_number
from hybridpar.training.spikes import check_skips, find_spike, spike_reason

# -- the pieces, against hand computations ------------------------------------------------------------------------


def test_spike_test_is_mean_plus_k_std_and_a_minimum_rise():
    history = [5.0, 5.2, 4.8, 5.1, 4.9]
    mean, std = statistics.mean(history), statistics.stdev(history)  # 5.0, 0.158...
    assert spike_reason("loss", mean + 6.01 * std, history, 6.0, 0.0) is not None
    assert spike_reason("loss", mean + 5.99 * std, history, 6.0, 0.0) is None
    # 6.2 sigmas is only +19.6% here: a 20% minimum rise holds it back
    assert spike_reason("loss", mean + 6.2 * std, history, 6.0, 0.2) is None
    why = spike_reason("loss", 7.0, history, 6.0, 0.2)
    assert why == f"loss 7 is {(7.0 - mean) / std:.1f} standard deviations above the mean 5 of the last 5 steps (+40%)"
    # a flat window: any rise beyond min_rise is one (infinitely many sigmas)
    assert "inf standard deviations" in spike_reason("loss", 5.6, [5.0] * 5, 6.0, 0.1)


def test_spike_test_waits_for_a_full_window_and_tests_the_norm_when_asked():
    cfg = SpikeConfig(window=4, zscore=3.0, min_rise=0.1)
    history = [(5.0, 1.0), (5.1, 1.1), (4.9, 0.9), (5.0, 1.0)]
    assert find_spike(cfg, history[:3], 50.0, 1.0) is None  # 3 of 4 steps: no test yet
    assert find_spike(cfg, history, 50.0, 1.0).startswith("loss 50")
    assert find_spike(cfg, history, 5.0, 100.0) is None  # the norm is not tested by default
    assert find_spike(replace(cfg, grad_norm_zscore=3.0), history, 5.0, 100.0).startswith("gradient norm 100")
    # a norm 60% above its window's mean (many sigmas): past min_rise (10%), short of grad_norm_min_rise (100%), so
    # no spike; the norm's own minimum is what decides, never the loss's
    norms = replace(cfg, grad_norm_zscore=3.0, grad_norm_min_rise=1.0)
    assert find_spike(norms, history, 5.0, 1.6) is None
    assert find_spike(replace(norms, grad_norm_min_rise=0.5), history, 5.0, 1.6).startswith("gradient norm 1.6")


def test_batch_numbers_skip_the_windows():
    windows = merge_windows([(5, 7), (9, 9), (8, 8), (20, 22)])
    assert windows == [(5, 9), (20, 22)]
    skipped = {b for a, z in windows for b in range(a, z + 1)}
    trained = [b for b in range(1, 100) if b not in skipped]  # by enumeration
    assert [batch_number(k, windows) for k in range(1, 60)] == trained[:59]


def test_skipped_batches_must_be_ahead_and_fit_the_split():
    cfg = Config(train=TrainConfig(steps=10), data=DataConfig(skip_batches=["5-9"]))
    windows = cfg.data.skip_windows
    assert check_skips(cfg, 0, [], windows, 15) is None  # steps 1-10 train batches 1-4 and 10-15
    assert str(check_skips(cfg, 0, [], windows, 14)) == ("data.skip_batches: train.steps=10 past the skipped "
                                                         "batches would end at batch 15, but the train split holds "
                                                         "14: skip fewer batches or lower train.steps")
    assert "batch 5 was trained already (the run is at step 6, batch 6)" in str(check_skips(cfg, 6, [], windows, 15))
    assert check_skips(cfg, 6, [(5, 9)], windows, 15) is None  # the checkpoint skipped them already
    # the boundary: at step 6 (nothing skipped) batch 6 is the last trained one, batch 7 the next
    for window, refused in (("6-8", True), ("7-8", False)):
        cfg = Config(train=TrainConfig(steps=10), data=DataConfig(skip_batches=[window]))
        why = check_skips(cfg, 6, [], cfg.data.skip_windows, 15)
        assert (why is not None) == refused and (not refused or "batch 6 was trained already" in str(why)), window


def test_a_skipped_batches_file_that_is_not_a_rewinds_record_is_refused_naming_it(tmp_path):
    """Ignored, a damaged skipped_batches.json would let a resume train its batches again: each is a one-line
    CheckpointError naming the file; an absent file is no skips."""
    from hybridpar.checkpoint.recovery import read_skipped, write_skipped
    from hybridpar.errors import CheckpointError

    assert read_skipped(tmp_path) == ([], 0)
    write_skipped(tmp_path, [(20, 22), (5, 5)], 2)
    assert read_skipped(tmp_path) == ([(5, 5), (20, 22)], 2)
    path = tmp_path / "skipped_batches.json"
    for text, why in [('{"windows": [[20, 22]]', "JSONDecodeError"), ('{"windows": [[3, 2]], "rewinds": 1}', "1 <= a"),
                      ('{"windows": [[0, 2]], "rewinds": 1}', "1 <= a"), ('{"windows": [[2, 3]], "rewinds": -1}', ">= 0"),
                      ('{"windows": [[2, 3]], "rewinds": "1"}', ">= 0"), ('{"windows": [[2]], "rewinds": 1}', "ValueError"),
                      ('{"rewinds": 1}', "KeyError"), ("[" * 100_000, "RecursionError"), (" " * (1 << 20) + "{}", "small")]:
        path.write_text(text)
        with pytest.raises(CheckpointError) as e:
            read_skipped(tmp_path)
        assert str(e.value).startswith(f"{path} is not a record of skipped batches (") and why in str(e.value), text
        assert "\n" not in str(e.value) and len(str(e.value)) < 300
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a small regular file"):
        read_skipped(tmp_path)


def test_bad_spike_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"train.spike='on': use off, warn or rewind"):
        TrainConfig(spike="on")
    with pytest.raises(ValueError, match="spike.window=1 must be >= 2"):
        SpikeConfig(window=1)
    with pytest.raises(ValueError, match="spike.rerun='twice'"):
        SpikeConfig(rerun="twice")
    with pytest.raises(ValueError, match=r"data.skip_batches='9-3': a range A-B needs 1 <= A <= B"):
        DataConfig(skip_batches=["9-3"])
    with pytest.raises(ValueError, match=r"data.skip_batches='x': give ranges"):
        DataConfig(skip_batches=["x"])
    with pytest.raises(ValueError, match="train.spike=rewind goes back to a checkpoint: set --checkpoint.interval"):
        Config(train=TrainConfig(spike="rewind"))


# -- real runs ------------------------------------------------------------------------------------------------------

STEPS, G, POISONED = 28, 8, 22
COMMON = ["--train.steps", str(STEPS), "--train.global_batch_size", str(G), "--train.seq_len", "64",
          "--logging.interval", "1", "--train.eval_interval", "0", "--train.sample_tokens", "0",
          "--train.precision", "fp32", "--checkpoint.interval", "3", "--checkpoint.keep_last", "20",
          "--logging.wandb.mode", "disabled", "--train.spike", "rewind", "--spike.window", "8", "--spike.skip", "3"]


def _poison(cache_dir, out, args, batches=(POISONED,)):
    """The built-in corpus as an indexed copy whose global batches `batches` (default POISONED) hold random tokens
    in the sample order of a run with `args`; returns the arguments that train on it."""
    from hybridpar.config.cli import load_config
    from hybridpar.data.dataset import load_data_tokenizer, prepare_builtin
    from spike_data import poison_batches

    d = DataConfig(cache_dir=str(cache_dir))
    tokenizer = load_data_tokenizer(d)
    prefix, _ = prepare_builtin(d, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out)
    args = [*args, "--data.cache_dir", str(cache_dir), "--data.tokenizer", f"bpe:{out / 'tokenizer.json'}"]
    cfg = load_config([*args, "--data.path", prefix, "--model.vocab_size", "4096"])
    assert poison_batches(cfg, list(batches), str(out / "data")) >= len(batches) * G * 64  # every token, at least
    return [*args, "--data.path", str(out / "data")]


@pytest.fixture(scope="module")
def poisoned(cache_dir, tmp_path_factory):
    return _poison(cache_dir, tmp_path_factory.mktemp("poisoned"), COMMON)


def _run(args, run_dir, nproc=1, drill=None, code=0):
    script = ["tests/fault_drill.py", *map(str, drill)] if drill else ["launch/pretrain_gpt.py"]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    out = run_cli([*launch, *script, *args, "--run.dir", str(run_dir)])
    assert out.returncode == code, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def _assert_same_run(a, b, from_step):
    got, want = loss_curve(a), loss_curve(b)
    assert {s: got[s] for s in want if s > from_step} == {s: want[s] for s in want if s > from_step}
    wa, wb = load_full_model_state(checkpoint_dir(a, STEPS)), load_full_model_state(checkpoint_dir(b, STEPS))
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


def _rewinds(run_dir):
    return [(r["step"], r["rewind_to"], r["skipped_batches"], r["samples_skipped"], r["rewind_source"])
            for r in metrics_rows(run_dir) if "rewind" in r]


@pytest.fixture(scope="module")
def rewound(poisoned, tmp_path_factory):
    a = tmp_path_factory.mktemp("rewound") / "run"
    out = _run(poisoned, a)
    # The poisoned batch spikes the loss; the rewind goes to the newest checkpoint before the 3 skipped batches.
    assert _rewinds(a) == [(POISONED, 18, "20-22", 3 * G, "host memory")], out.stdout[-3000:]
    return a


@pytest.mark.multiprocess
def test_a_rewound_run_equals_a_resume_with_the_batches_skipped(rewound, poisoned, tmp_path):
    a = rewound
    assert json.loads((a / "skipped_batches.json").read_text()) == {"windows": [[20, 22]], "rewinds": 1}
    state = read_trainer_state(checkpoint_dir(a, STEPS))
    assert state["skip_windows"] == [[20, 22]] and state["rewinds"] == 1 and state["consumed_samples"] == STEPS * G
    # The checkpoint it went back to, alone (not beside the run's skipped_batches.json), resumed with the same
    # batches skipped by hand: the same losses and final weights, bitwise.
    (tmp_path / "copy").mkdir()
    start = shutil.copytree(checkpoint_dir(a, 18), tmp_path / "copy" / "step_00000018")
    b = tmp_path / "resumed"
    _run([*poisoned, "--checkpoint.load", str(start), "--data.skip_batches", "20-22"], b)
    _assert_same_run(a, b, 18)
    assert not any("rewind" in r for r in metrics_rows(b))
    # A batch the checkpoint has trained already cannot be skipped: one line, nothing written.
    out = run_cli(["launch/pretrain_gpt.py", *poisoned, "--checkpoint.load", str(start), "--data.skip_batches", "5",
                   "--run.dir", str(tmp_path / "late")])
    assert out.returncode == 2 and out.stderr.strip() == ("error: data.skip_batches: batch 5 was trained already "
                                                         "(the run is at step 18, batch 18); skip batches after 18")
    assert not (tmp_path / "late" / "metrics.jsonl").exists()


@pytest.mark.multiprocess
def test_a_rewind_from_disk_equals_one_from_host_memory(rewound, poisoned, tmp_path):
    d = tmp_path / "disk"
    _run([*poisoned, "--spike.keep_in_memory", "0", "--logging.wandb.mode", "offline"], d)
    assert _rewinds(d) == [(POISONED, 18, "20-22", 3 * G, "disk")]
    _assert_same_run(rewound, d, 0)
    # W&B, whose step only grows, has each step once (the first pass) and the rewind at the spiking step.
    from wandb_file import history

    rows = history(next(d.glob("wandb/offline-run-*/run-*.wandb")))
    assert [r["_step"] for r in rows] == list(range(1, STEPS + 1))
    assert [(r["_step"], r["rewind_to"], r["rewind_source"]) for r in rows if "rewind" in r] == [(POISONED, 18, "disk")]


@pytest.mark.multiprocess
def test_killed_after_a_rewind_the_resume_does_not_train_the_skipped_batches(rewound, poisoned, tmp_path):
    """Checkpoints every 9 steps: the rewind at step 22 goes back to 18 and the next save is at 27. The run is
    killed between the two; the same command resumes from 18 with the skipped batches of skipped_batches.json."""
    run_dir, args = tmp_path / "run", [*poisoned, "--checkpoint.interval", "9"]
    with open(tmp_path / "console.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "launch/pretrain_gpt.py", *args, "--run.dir", str(run_dir)],
                                cwd=ROOT, env=user_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not (
                (run_dir / "metrics.jsonl").exists() and any("rewind" in r for r in _rows(run_dir))):
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert [step_of(p) for p in list_checkpoints(run_dir)] == [9, 18], (tmp_path / "console.txt").read_text()
    _run(args, run_dir)
    _assert_same_run(rewound, run_dir, 0)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]


@pytest.mark.multiprocess
def test_warn_lr_scale_and_a_spike_past_max_rewinds(rewound, poisoned, cache_dir, tmp_path):
    warn = _poison(cache_dir, tmp_path / "warn-data", [*COMMON, "--train.spike", "warn"])
    _run(warn, tmp_path / "warn")
    rows = metrics_rows(tmp_path / "warn")
    assert [r["step"] for r in rows if "spike" in r] == [POISONED] and not any("rewind" in r for r in rows)
    assert max(loss_curve(tmp_path / "warn")) == STEPS
    # The learning rate after a rewind: x 0.5 for the 3 steps after the checkpoint, then the schedule again.
    scaled = tmp_path / "scaled"
    _run([*poisoned, "--spike.lr_scale", "0.5", "--spike.lr_steps", "3"], scaled)
    lr, want = {r["step"]: r["lr"] for r in metrics_rows(scaled) if "loss" in r}, step_rows(rewound)
    assert [lr[s] for s in range(17, 24)] == [want[s]["lr"] * (0.5 if s in (19, 20, 21) else 1) for s in range(17, 24)]
    out = _run([*poisoned, "--spike.max_rewinds", "0"], tmp_path / "limit", code=3)
    assert out.stderr.strip().splitlines()[-1].startswith(
        f"error: loss spike at step {POISONED} (loss ") and "after 0 rewind(s), spike.max_rewinds=0: stopping" in \
        out.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("rerun", ["same", "rotate"])
def test_rerun_tells_a_fault_from_the_data_and_names_the_rank(rerun, poisoned, tmp_path):
    """Two ranks (FSDP over 2). Rank 1's gradient shards are multiplied by 1000 once, in step 10 (a transient fault);
    batch 22 holds random tokens. The rerun of step 10 differs on rank 1 only: training goes on from the replayed
    step, nothing skipped. The rerun of step 22 gives the same numbers: the data; its batches are skipped. What
    remains equals a run that never had the fault, with those batches skipped by hand, bitwise."""
    flags = [*poisoned, "--spike.rerun", rerun, "--spike.grad_norm_zscore", "20", "--spike.grad_norm_min_rise", "20"]
    a = tmp_path / "drill"
    out = _run(flags, a, nproc=2, drill=(1, 10, 1000.0))
    rows = metrics_rows(a)
    faults = [(r["step"], r["fault"]) for r in rows if "fault" in r]
    what = "loss of its neighbour's batch or gradient-shard norm" if rerun == "rotate" else \
        "loss share or gradient-shard norm"
    assert faults == [(10, f"step 10: rank(s) 1 computed another {what}")], out.stdout[-3000:]
    assert [(r["step"], r["skipped_batches"]) for r in rows if "rewind" in r] == [(POISONED, "20-22")]
    b = tmp_path / "clean"
    _run([*flags, "--data.skip_batches", "20-22"], b, nproc=2)
    _assert_same_run(a, b, 0)
    assert [r for r in metrics_rows(b) if "fault" in r or "rewind" in r] == []


@pytest.mark.multiprocess
def test_a_rewind_on_two_data_parallel_ranks_after_a_validation(poisoned, tmp_path):
    """FSDP's root keeps its parameters gathered after a forward; validation at the spiking step (no backward after
    it) left them gathered, and the host copy, read through the module, saw other tensors than those it took
    (a RuntimeError on 2 ranks). The rewind from host memory, the one from disk and the resume from the same
    checkpoint with the batches skipped by hand train the same steps, bitwise."""
    args = [*poisoned, "--train.eval_interval", "2"]  # validation at step 22, the spike's
    runs = {}
    for name, extra in (("memory", []), ("disk", ["--spike.keep_in_memory", "0"])):
        _run([*args, *extra], tmp_path / name, nproc=2)
        runs[name] = tmp_path / name
    assert _rewinds(runs["memory"]) == [(POISONED, 18, "20-22", 3 * G, "host memory")]
    assert _rewinds(runs["disk"]) == [(POISONED, 18, "20-22", 3 * G, "disk")]
    (tmp_path / "copy").mkdir()
    start = shutil.copytree(checkpoint_dir(runs["memory"], 18), tmp_path / "copy" / "step_00000018")
    by_hand = tmp_path / "by-hand"
    _run([*args, "--checkpoint.load", str(start), "--data.skip_batches", "20-22"], by_hand, nproc=2)
    _assert_same_run(runs["memory"], runs["disk"], 0)
    _assert_same_run(runs["memory"], by_hand, 18)
    # the two-rank run's validation losses after the rewind are those of the resume, bitwise
    val = {n: {r["step"]: r["val_loss"] for r in metrics_rows(d) if "val_loss" in r and r["step"] > 18}
           for n, d in (("memory", runs["memory"]), ("by_hand", by_hand))}
    assert val["memory"] == val["by_hand"] and len(val["memory"]) == 5


@pytest.mark.multiprocess
def test_two_rewinds_to_one_checkpoint_and_a_resume_that_skipped_batches_then_rewound(cache_dir, tmp_path):
    """Batches 22 and 24 poisoned. The run spikes on batch 22 (step 22: back to 18, 20-22 skipped), then on batch 24
    (trained at step 21 now, after 19 and 23: those three skipped, and checkpoint 18 is again the newest before
    them): two rewinds to one host copy. Checkpoint 9, resumed alone with batches 12-13 skipped by hand, meets batch
    22 at step 20 and, back at 15, batch 24 at step 19: back to 15 again. Each equals a run from the same start with every window skipped by hand
    (no spike at all): the same losses and final weights, bitwise; skipped_batches.json and the last checkpoint hold
    the merged windows."""
    data = _poison(cache_dir, tmp_path / "data", COMMON, batches=(22, 24))
    run = tmp_path / "run"
    _run(data, run)
    assert _rewinds(run) == [(22, 18, "20-22", 3 * G, "host memory"), (21, 18, "19, 23-24", 3 * G, "host memory")]
    assert json.loads((run / "skipped_batches.json").read_text()) == {"windows": [[19, 24]], "rewinds": 2}
    by_hand = tmp_path / "by-hand"
    _run([*data, "--data.skip_batches", "19-24"], by_hand)
    assert _rewinds(by_hand) == []
    _assert_same_run(run, by_hand, 0)

    (tmp_path / "copy").mkdir()
    start = shutil.copytree(checkpoint_dir(run, 9), tmp_path / "copy" / "step_00000009")
    resumed = tmp_path / "resumed"
    _run([*data, "--checkpoint.load", str(start), "--data.skip_batches", "12-13"], resumed)
    assert _rewinds(resumed) == [(20, 15, "20-22", 3 * G, "host memory"),
                                 (19, 15, "19, 23-24", 3 * G, "host memory")]
    state = read_trainer_state(checkpoint_dir(resumed, STEPS))
    assert state["skip_windows"] == [[12, 13], [19, 24]] and state["rewinds"] == 2
    assert state["consumed_samples"] == STEPS * G
    reference = tmp_path / "reference"
    _run([*data, "--checkpoint.load", str(start), "--data.skip_batches", "12-13,19-24"], reference)
    _assert_same_run(resumed, reference, 9)
