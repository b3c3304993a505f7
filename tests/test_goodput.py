"""Goodput (hybridpar/training/goodput.py, launch/goodput.py): a run with a spike rewind, a kill -9, a SIGTERM
preemption and checkpoints accounts for its wall clock: the parts sum to it within 2%, and each lost part equals
what was done (the redone steps' logged step times, the saves' stalls as the saves report them)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, launcher, metrics_rows, run_cli, user_env

STEPS = 14
ARGS = ["--train.steps", str(STEPS), "--train.global_batch_size", "8", "--train.seq_len", "64",
        "--logging.interval", "1", "--train.eval_interval", "0", "--train.sample_tokens", "0",
        "--train.eval_tasks", "", "--train.precision", "fp32", "--checkpoint.interval", "4",
        "--checkpoint.keep_last", "20", "--logging.wandb.mode", "disabled", "--train.spike", "rewind",
        "--spike.window", "4", "--spike.skip", "2", "--spike.grad_norm_zscore", "6", "--model.n_layers", "2"]


def _start(script, run_dir, cache_dir, log):
    return subprocess.Popen([sys.executable, *script, *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir",
                             str(run_dir)], cwd=ROOT, env=user_env(), stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait(proc, until, log_path):
    deadline = time.time() + 300
    while not until() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, log_path.read_text()[-3000:]


def _steps_logged(run_dir, step):
    path = run_dir / "metrics.jsonl"
    return path.read_text().count(f'{{"step": {step}, "loss"') if path.exists() else 0


@pytest.mark.multiprocess
def test_the_parts_add_up_to_the_wall_clock_through_a_rewind_a_kill_and_a_preemption(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    logs = [tmp_path / f"start{i}.log" for i in range(3)]
    with open(logs[0], "w") as log:  # a gradient fault at step 7: rewound to step 4; then killed after step 10
        proc = _start(["tests/fault_drill.py", "0", "7", "1000"], run_dir, cache_dir, log)
        _wait(proc, lambda: _steps_logged(run_dir, 10) >= 1, logs[0])
        proc.kill()
        proc.wait()
    first = metrics_rows(run_dir)
    rewind = next(i for i, r in enumerate(first) if "rewind" in r)
    assert first[rewind]["rewind_to"] == 4, first[rewind]
    # A row's step_time is the time since the row before, which holds the save of a checkpoint step before it:
    # taken out, as the save reported its stall
    blocked = {int(a): float(b) for a, b in re.findall(r"step_(\d+) \(step loop blocked ([0-9.]+)s\)",
                                                        logs[0].read_text())}
    undone = sum(r["step_time"] for r in first[:rewind] if "loss" in r and r["step"] > 4) - blocked[4]  # 5-7
    redone = sum(r["step_time"] for r in first[rewind:] if "loss" in r and r["step"] > 8) - blocked[8]
    with open(logs[1], "w") as log:  # resumed from checkpoint 8; preempted (SIGTERM) after step 11
        proc = _start(["launch/pretrain_gpt.py"], run_dir, cache_dir, log)
        _wait(proc, lambda: _steps_logged(run_dir, 11) >= 1, logs[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 75, logs[1].read_text()[-3000:]
    out = run_cli(["launch/pretrain_gpt.py", *ARGS, "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    logs[2].write_text(out.stdout)
    text = "".join(p.read_text() for p in logs)
    assert "resuming from" in logs[1].read_text() and "resuming from" in out.stdout
    saved = json.loads((run_dir / "goodput.json").read_text())
    s, wall = saved["seconds"], saved["last_seen"] - saved["first_start"]
    # the parts sum to the wall clock of all three starts and the gaps between them, within 2%
    assert abs(wall - sum(s.values())) <= 0.02 * wall, (wall, s)
    # each lost part is what was done: the first pass of steps 5-7 (rewound), the steps after checkpoint 8 that
    # the killed start trained (as its rows logged them), the saves' blocking time (as the saves said)
    assert s["rewind_redo"] == pytest.approx(undone, rel=0.1, abs=0.05), (s, undone)
    assert s["restart_redo"] == pytest.approx(redone, rel=0.1, abs=0.05), (s, redone)
    stalls = sum(float(x) for x in re.findall(r"step loop blocked ([0-9.]+)s", text))
    assert s["checkpoint_stall"] == pytest.approx(stalls, rel=0.1, abs=0.05), (s, stalls)
    print(f"goodput test: wall {wall:.2f}s, other {wall - sum(s.values()):.3f}s, rewind_redo {s['rewind_redo']:.3f}s "
          f"vs {undone:.3f}s logged, restart_redo {s['restart_redo']:.3f}s vs {redone:.3f}s, checkpoint_stall "
          f"{s['checkpoint_stall']:.3f}s vs {stalls:.3f}s reported")
    assert s["rewind"] > 0 and s["down"] > 0 and s["startup"] > 0 and s["skipped_nonfinite"] == 0
    rows = [r for r in metrics_rows(run_dir) if "goodput" in r]
    last = rows[-1]
    assert last["step"] == STEPS and 0 < last["goodput"] < 1
    assert last["goodput"] == pytest.approx(last["goodput/productive_s"] / last["goodput/wall_s"], rel=1e-3)
    out = run_cli(["launch/goodput.py", str(run_dir), "--out", str(tmp_path / "goodput.png")])
    assert out.returncode == 0, out.stderr
    assert re.search(r"^restart_redo +[0-9.]+ ", out.stdout, re.M) and f"goodput {s['productive'] / wall:.1%}" in \
        out.stdout and (tmp_path / "goodput.png").stat().st_size > 0
    # a damaged record: said, and the accounting starts again (the run still trains)
    (run_dir / "goodput.json").write_text('{"first_start": "yesterday"}')
    out = run_cli(["launch/goodput.py", str(run_dir)])
    assert out.returncode == 2 and out.stderr.startswith(f"error: {run_dir / 'goodput.json'} is unreadable"), \
        out.stderr


def test_the_record_by_hand_restart_rewind_skip_and_a_damaged_file(tmp_path, capsys):
    from hybridpar.training.goodput import Goodput

    g = Goodput.begin(tmp_path, 100.0, 0)  # a first start at t = 100 s
    g.add("startup", 5.0)
    for step in range(1, 7):
        g.stepped(step, 1.0 + step / 10)  # steps 1-6: 1.1 .. 1.6 s
    g.skipped(2)  # step 2's update skipped: its 1.2 s was not productive
    g.rewound(4, 0.5)  # steps 5 and 6 undone (1.5 + 1.6 s)
    assert g.seconds["rewind_redo"] == pytest.approx(3.1) and g.seconds["skipped_nonfinite"] == pytest.approx(1.2)
    assert g.seconds["productive"] == pytest.approx(1.1 + 1.3 + 1.4) and g.seconds["rewind"] == 0.5
    g.stepped(5, 2.0)
    g.skipped(6)  # step 6's skip known before its time is (its status read in the step that logs it)
    g.stepped(6, 1.5)
    g.stepped(6, 0.5)  # (its row's writing)
    assert g.seconds["skipped_nonfinite"] == pytest.approx(3.2) and g.seconds["productive"] == pytest.approx(5.8)
    g.rewound(5, 0.0)  # step 6 undone: lost once already, as skipped
    assert g.seconds["rewind_redo"] == pytest.approx(3.1) and g.seconds["productive"] == pytest.approx(5.8)
    g.stepped(6, 2.0)  # trained again: productive this time
    g.save(tmp_path, checkpoints=[4])  # the record holds steps 0, 4 and the last
    saved = json.loads((tmp_path / "goodput.json").read_text())
    assert sorted(saved["productive_at"]) == ["0", "4", "6"]
    again = Goodput.begin(tmp_path, saved["last_seen"] + 30.0, 4)  # 30 s later, resumed from checkpoint 4
    assert again.seconds["restart_redo"] == pytest.approx(4.0) and again.seconds["down"] == pytest.approx(30.0)
    assert again.seconds["productive"] == pytest.approx(3.8) and again.first_start == 100.0
    row = again.row(saved["last_seen"] + 30.0)
    assert row["goodput/wall_s"] == pytest.approx(saved["last_seen"] + 30.0 - 100.0, abs=1e-3)
    for text in ("{", '{"first_start": 1, "last_seen": 0, "seconds": {}, "productive_at": {}}', "[]",
                 '{"first_start": 1, "last_seen": 2, "seconds": {"productive": -1}, "productive_at": {}}'):
        (tmp_path / "goodput.json").write_text(text)
        fresh = Goodput.begin(tmp_path, 500.0, 4)
        assert fresh.first_start == 500.0 and sum(fresh.seconds.values()) == 0, text
        assert len(fresh.notes) == 1 and "is unreadable" in fresh.notes[0], text
    # Not a record at all: a link to an endless device, a directory, a file past any record's size. Each is a note
    # and a fresh account, read without loading it (an endless read was a MemoryError); the command says it in one
    # line and a missing --out directory is refused before the table.
    goodput = launcher("goodput")
    (tmp_path / "goodput.json").unlink()
    for make, why in [(lambda f: f.symlink_to("/dev/zero"), "not a regular file"), (lambda f: f.mkdir(), "not a regular"),
                      (lambda f: f.write_text(" " * (1 << 20) + "{}"), "larger than 1,048,576 bytes")]:
        make(tmp_path / "goodput.json")
        fresh = Goodput.begin(tmp_path, 500.0, 4)
        assert fresh.first_start == 500.0 and len(fresh.notes) == 1 and why in fresh.notes[0], fresh.notes
        assert goodput.cli([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1, err
        f = tmp_path / "goodput.json"
        f.rmdir() if f.is_dir() and not f.is_symlink() else f.unlink()
    g.save(tmp_path, checkpoints=[4])
    assert goodput.cli([str(tmp_path), "--out", str(tmp_path / "none" / "g.png")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == (f"error: --out {tmp_path / 'none' / 'g.png'}: directory {tmp_path / 'none'} "
                                         f"does not exist; create it first or name a file in an existing directory")
    assert not (tmp_path / "none").exists()


_FULL = """
set -u
mount -t tmpfs -o size=64k tmpfs "$MNT" || exit 90
cd "$ROOT"
"$PY" - <<'PY'
import json, os, sys
from pathlib import Path
from hybridpar.errors import UserError
from hybridpar.training.goodput import Goodput
run = Path(os.environ["MNT"])
g = Goodput.begin(run, 100.0, 0)
g.stepped(1, 1.5)
g.save(run, checkpoints=[])
before = (run / "goodput.json").read_text()
with open(run / "filler", "wb", buffering=0) as f:  # the rest of the file system
    try:
        while True:
            f.write(b"x" * 4096)
    except OSError:
        pass
g.stepped(2, 1.5)
try:
    g.save(run, checkpoints=[])
except UserError as e:
    print(json.dumps({"error": str(e), "kept": (run / "goodput.json").read_text() == before,
                      "files": sorted(os.listdir(run))}))
PY
"""


@pytest.mark.multiprocess
def test_a_full_file_system_stops_the_record_with_one_line_and_keeps_the_last(tmp_path):
    """goodput.json written on a real full file system (a 64 KiB tmpfs in a private mount namespace): a one-line
    error naming the file and the fix, the previous record intact and no temporary file left."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**user_env(), "MNT": str(mnt), "ROOT": str(ROOT), "PY": sys.executable}
    done = subprocess.run(["unshare", "-m", "bash", "-c", _FULL], env=env, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["error"].startswith(f"writing {mnt / 'goodput.json'}: no space left on device; free space there")
    assert "\n" not in out["error"] and out["kept"] and out["files"] == ["filler", "goodput.json"]



@pytest.mark.multiprocess
def test_data_wait_is_the_time_a_slow_loader_took(tmp_path, cache_dir):
    """A train loader that sleeps 0.25 s in each step's fetch (tests/slow_loader.py): the record's data_wait is the
    6 steps' 1.5 s (at least that; the real fetch adds milliseconds), and it is not counted productive: productive
    plus data_wait is at most the steps' logged time."""
    run_dir = tmp_path / "run"
    out = run_cli(["tests/slow_loader.py", "0.25", "--train.steps", "6", "--train.global_batch_size", "8",
                   "--train.seq_len", "32", "--logging.interval", "1", "--train.eval_interval", "0",
                   "--train.sample_tokens", "0", "--train.eval_tasks", "", "--model.n_layers", "1",
                   "--logging.wandb.mode", "disabled", "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads((run_dir / "goodput.json").read_text())["seconds"]
    assert 1.5 <= s["data_wait"] <= 1.5 + 6 * 0.05, s
    rows = [r for r in metrics_rows(run_dir) if "loss" in r]
    assert len(rows) == 6 and all(r["data_time"] * r["step_time"] >= 0.25 * 0.99 for r in rows), rows
    assert s["productive"] + s["data_wait"] <= sum(r["step_time"] for r in rows) + 0.05, s


@pytest.mark.multiprocess
def test_a_skipped_non_finite_step_then_a_rewind_past_it_each_counted_once(tmp_path, cache_dir):
    """Step 5's gradients are made infinite (its update skipped, its status read in the step that logs it), step
    7's multiplied by 1000 (a spike: rewound to checkpoint 4). skipped_nonfinite is step 5's logged time, rewind_redo
    steps 6-7's (step 5's is not counted twice), less the save of checkpoint 4 that step 5's row holds."""
    run_dir, log = tmp_path / "run", tmp_path / "console.txt"
    out = run_cli(["tests/fault_drill.py", "0", "5,7", "inf,1000", *ARGS, "--data.cache_dir", str(cache_dir),
                   "--run.dir", str(run_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    log.write_text(out.stdout)
    rows = metrics_rows(run_dir)
    rewind = next(i for i, r in enumerate(rows) if "rewind" in r)
    assert rows[rewind]["rewind_to"] == 4 and "step 5: gradient norm is nan; optimizer step skipped" in out.stdout
    first = {r["step"]: r["step_time"] for r in rows[:rewind] if "loss" in r}
    blocked = float(re.search(r"step_00000004 \(step loop blocked ([0-9.]+)s\)", out.stdout).group(1))
    saved = json.loads((run_dir / "goodput.json").read_text())
    s, wall = saved["seconds"], saved["last_seen"] - saved["first_start"]
    assert s["skipped_nonfinite"] == pytest.approx(first[5] - blocked, rel=0.1, abs=0.05), (s, first, blocked)
    assert s["rewind_redo"] == pytest.approx(first[6] + first[7], rel=0.1, abs=0.05), (s, first)
    assert abs(wall - sum(s.values())) <= 0.02 * wall, (wall, s)
