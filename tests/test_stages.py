"""Data stages (data.stages): the position-keyed rule against plain-Python references written here, the binomial
spread of the draws, the same global batches for any data-parallel size, and, through the real launcher, a staged
run killed inside a stage and at a boundary resuming with the same samples (also on another layout), changed stages
refused or applied from the resume point, and a source that runs out."""

from __future__ import annotations

import math
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from conftest import ROOT, launcher, metrics_rows, run_cli, step_rows, user_env
from hybridpar.checkpoint.layout import checkpoint_dir
from hybridpar.data.gpt_data import GlobalBatchLoader, build_passes, check_prefixes
from hybridpar.data.indexed import DataError, IndexedTokens, IndexedWriter
from hybridpar.data.stages import (StagedDataset, StagePlan, StageSampler, draw_sources, stage_micro_batch,
                                   uniform)
from hybridpar.data.tokenizer import ByteTokenizer
from hybridpar.errors import ConfigError

MASK = 2 ** 64 - 1


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser as published (Steele, Lea, Flood 2014), on Python ints."""
    z = x & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _u(p: int, seed: int) -> float:
    return (_splitmix64(p + (seed + 1) * 0x9E3779B97F4A7C15) >> 11) / 2 ** 53


def _source(weights: list[float], u: float) -> int:
    """Inverse CDF by hand: the first source whose running weight share exceeds u."""
    acc, total = 0.0, sum(weights)
    for s, w in enumerate(weights):
        acc += w
        if w > 0 and u < acc / total:
            return s
    return max(s for s, w in enumerate(weights) if w > 0)


def test_uniform_is_splitmix64_of_the_documented_key():
    positions = [0, 1, 2, 63, 10 ** 6, 2 ** 40 + 7, 2 ** 62]
    for seed in (0, 1, 1234):
        got = uniform(np.array(positions, dtype=np.uint64), seed)
        assert [float(v) for v in got] == [_u(p, seed) for p in positions]
        assert all(0.0 <= v < 1.0 for v in got)


def test_ramp_weights_at_chosen_positions_by_hand():
    # G = 4: stage 2 starts at batch 5 = sample 20 and ramps over 2 batches = 8 samples; stage 3 at sample 30.
    plan = StagePlan.parse(["0: 3 a 1 b", "5 ramp 2: 1 b 1 c", "30s: c"], global_batch=4, seq_len=32)
    assert plan.sources == ("a", "b", "c")
    assert [(s.start, s.ramp, s.seq_len) for s in plan.stages] == [(0, 0, 32), (20, 8, 32), (30, 0, 32)]
    expect = {0: (0.75, 0.25, 0), 19: (0.75, 0.25, 0), 20: (0.75, 0.25, 0), 22: (0.5625, 0.3125, 0.125),
              24: (0.375, 0.375, 0.25), 27: (0.09375, 0.46875, 0.4375), 28: (0, 0.5, 0.5), 29: (0, 0.5, 0.5),
              30: (0, 0, 1), 10 ** 9: (0, 0, 1)}
    got = plan.weights_at(np.array(list(expect)))
    for row, want in zip(got, expect.values()):
        assert np.allclose(row, want, rtol=0, atol=1e-15), (row, want)
    assert [plan.stage_at(p) for p in (0, 19, 20, 29, 30, 10 ** 9)] == [1, 1, 2, 2, 3, 3]


def test_draws_follow_the_weights_and_the_written_rule():
    n = 10_000
    weights = [(0.7, 0.3, 0.0), (0.2, 0.5, 0.3), (0.0, 0.0, 1.0)]
    plan = StagePlan.parse(["0: 0.7 a 0.3 b", f"{n}s: 0.2 a 0.5 b 0.3 c", f"{2 * n}s: c"], global_batch=8, seq_len=32)
    src = draw_sources(plan, np.arange(3 * n), seed=11)
    for k, w in enumerate(weights):
        counts = np.bincount(src[k * n:(k + 1) * n], minlength=3)
        for c, p in zip(counts, w):
            if p == 0:
                assert c == 0
            else:  # within 4 standard deviations of the binomial
                assert abs(c - n * p) <= 4 * math.sqrt(n * p * (1 - p)), (k, counts, w)
    for p in list(range(2000)) + list(range(n - 50, n + 50)):
        w = weights[min(p // n, 2)]
        assert src[p] == _source(list(w), _u(p, 11)), p


def test_a_stage_of_another_length_is_its_own_stream_with_its_own_micro_batch():
    plan = StagePlan.parse(["0: 0.5 a 0.5 b", "4 seq 64: a", "6: a"], global_batch=8, seq_len=32)
    assert plan.streams == (("a", 32), ("b", 32), ("a", 64)) and plan.sources == ("a", "b")
    assert [s.weights for s in plan.stages] == [(0.5, 0.5, 0.0), (0.0, 0.0, 1.0), (1.0, 0.0, 0.0)]
    assert [plan.seq_len_at(p) for p in (0, 31, 32, 47, 48)] == [32, 32, 64, 64, 32]
    # about the same tokens per microbatch, a divisor of the rank's share, at least 1 (worked by hand)
    assert [stage_micro_batch(*a) for a in [(8, 32, 64, 8), (2, 128, 512, 6), (4, 128, 64, 6), (4, 128, 96, 6),
                                            (3, 32, 32, 6)]] == [4, 1, 6, 3, 3]


def test_counts_and_reads_equal_a_loop_over_positions():
    G = 6
    plan = StagePlan.parse(["0: 0.5 a 0.5 b", "3 ramp 2: 1 c", "47s: 0.1 a 0.9 b"], global_batch=G, seq_len=32)
    sampler = StageSampler(plan, seed=3, global_batch=G)
    ref_src = [int(s) for s in draw_sources(plan, np.arange(20 * G), 3)]
    seen = [0, 0, 0]
    ref_index = []
    for s in ref_src:
        ref_index.append(seen[s])
        seen[s] += 1
    for b in range(20):
        assert sampler.counts_before(b).tolist() == [ref_src[:b * G].count(s) for s in range(3)]
    for start, stop in ((0, 6), (14, 18), (46, 48), (102, 108)):
        src, index = sampler.locate(range(start, stop))
        assert src.tolist() == ref_src[start:stop] and index.tolist() == ref_index[start:stop]
    # From an origin (a changed-stage resume at batch 7 with these counts), each source counts on from its own.
    moved = StageSampler(plan, seed=3, global_batch=G, origin=(7, np.array([100, 0, 5])))
    src, index = moved.locate(range(7 * G, 9 * G))
    base = {0: 100, 1: 0, 2: 5}
    for s, i in zip(src.tolist(), index.tolist()):
        assert i == base[s]
        base[s] += 1
    with pytest.raises(DataError, match="lies before batch 8, where the data stages were changed"):
        moved.counts_before(6)


@pytest.mark.parametrize("entries, message", [
    (["5: a"], "the first stage must start at 0"),
    (["0: a", "0: b"], "stages start in increasing order"),
    (["0 ramp 3: a"], "no previous weights to ramp from"),
    (["0: a", "4 ramp 4: b", "6: a"], "inside the previous stage's ramp"),
    (["0 a"], "write 'START[ ramp R][ seq L]: BLEND'"),
    (["0: a", "3s seq 64: a"], "changes the sequence length (32 -> 64): it must start on a global batch boundary"),
    (["0: a", "1 ramp 1 seq 64: a"], "changes the sequence length (32 -> 64)"),
    (["0 seq 0: a"], "seq 0 must be >= 1"),
    (["0: 0.5 a b"], "blend '0.5 a b': a blend is 'WEIGHT PREFIX"),
    (["0: -1 a 1 b"], "blend weight -1 must be a positive number"),
    (["0: 0.25 a 0.25 a 0.5 b"], "names a twice; name it once with the weights added (0.5)"),  # as data.path
])
def test_bad_stages_are_one_line_errors(entries, message):
    with pytest.raises(DataError, match=re.escape(message)) as e:
        StagePlan.parse(entries, global_batch=4, seq_len=32)
    assert "\n" not in str(e.value)
    if "twice" in message:  # the same rule for data.path (it used to add the weights, stages to keep the last)
        from hybridpar.data.stages import parse_blend

        with pytest.raises(DataError, match=re.escape(message)):
            parse_blend(entries[0][3:])


def _source_files(directory, n_docs=(300, 300), seed=0):
    """Sources of the bytes tokenizer's ids, each in its own id range (web 1-127, code 128-255), docs ending in EOD."""
    rng = np.random.default_rng(seed)
    prefixes = []
    for (name, lo, hi), n in zip((("web", 1, 128), ("code", 128, 256)), n_docs):
        prefixes.append(str(directory / name))
        with IndexedWriter(prefixes[-1], np.uint16) as w:
            for _ in range(n):
                w.add_document(np.append(rng.integers(lo, hi, int(rng.integers(20, 200))), 0).astype(np.uint16))
    return prefixes


def test_the_same_global_batches_on_1_2_and_4_ranks_and_the_reads_of_the_rule(tmp_path, one_process_group):
    web, code = _source_files(tmp_path, n_docs=(300, 40))
    plan = StagePlan.parse([f"0: {web}", f"3s ramp 2: 0.5 {web} 0.5 {code}", f"61s: {code}"], global_batch=8, seq_len=32)
    fractions = (0.95, 0.05, 0.0)
    tok = ByteTokenizer()
    check_prefixes([web, code], {p: IndexedTokens(p) for p in (web, code)}, "95,5,0", fractions, tok, 256, ("train",))
    args = ("95,5,0", fractions, 32, 7, tok, tmp_path / "cache")
    streams = [build_passes(p, range(3), *args)[0] for p in (web, code)]  # 3 passes each: code wraps
    assert len(streams[1][0]) < 200  # the small source is read past its first pass below
    n_batches = 40
    batches = {}
    for dp, micro in ((1, 8), (2, 2), (4, 1)):
        dataset = StagedDataset(StageSampler(plan, 7, 8), streams, n_batches * 8, ["web", "code"], micro, 32)
        loaders = [GlobalBatchLoader(dataset, 8, r, dp, 256, "train") for r in range(dp)]
        batches[dp] = [torch.cat([x for r in range(dp) for x, _ in loaders[r].microbatches(b)])
                       for b in range(n_batches)]
        for loader in loaders:
            loader.close()
    assert all(torch.equal(batches[dp][b], batches[1][b]) for dp in (2, 4) for b in range(n_batches))
    # Against the rule done by hand: source of each position by inverse CDF of u(p), its n-th unread sample, pass
    # n // L of that source (a pass is megatron-core's epoch for seed + 7919 e, built independently above).
    seen = [0, 0]
    for p in range(n_batches * 8):
        f = (p - 3) / 16  # the ramp's share of the way from (1, 0) to (0.5, 0.5)
        w = [1.0, 0.0] if p < 3 else ([(1 - f) + f * 0.5, f * 0.5] if p < 19 else
                                      ([0.5, 0.5] if p < 61 else [0.0, 1.0]))
        s = _source(w, _u(p, 7))
        n = seen[s]
        seen[s] += 1
        per_pass = len(streams[s][0])
        want = streams[s][n // per_pass][n % per_pass]["tokens"]
        assert torch.equal(batches[1][p // 8][p % 8], want), p
    assert seen[1] > len(streams[1][0])  # the rule read code's second pass
    assert not torch.equal(torch.stack([streams[1][1][i]["tokens"] for i in range(8)]),
                           torch.stack([streams[1][0][i]["tokens"] for i in range(8)]))  # reshuffled


# -- through the launcher --------------------------------------------------------------------------------------

STEPS = 12
G = 8


def _staged_args(tmp_path, run_dir, stages, *extra):
    return ["launch/pretrain_gpt.py", "--train.steps", str(STEPS), "--train.global_batch_size", str(G),
            "--train.seq_len", "32", "--logging.interval", "1", "--train.eval_interval", "6", "--train.eval_batches",
            "1", "--train.eval_tasks", "", "--train.sample_tokens", "0", "--train.precision", "fp32",
            "--checkpoint.interval", "2", "--checkpoint.keep_last", "10", "--logging.wandb.mode", "disabled",
            "--data.tokenizer", "bytes", "--data.cache_dir", str(tmp_path / "cache"), "--run.dir", str(run_dir),
            "--data.stages", ",".join(stages), *extra]


def _samples(rows):
    return {s: (r["stage"], r["samples/web"], r["samples/code"], r["batch_crc32"]) for s, r in rows.items()}


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Sources, stages (a ramp, a boundary inside global batch 8 at sample 61, a stage of 64-token sequences from
    batch 10, the run's being 32) and the unbroken reference run."""
    tmp = tmp_path_factory.mktemp("stages")
    web, code = _source_files(tmp)
    stages = [f"0: {web}", f"3 ramp 3: 0.5 {web} 0.5 {code}", f"61s: 0.25 {web} 0.75 {code}", f"10 seq 64: {code}"]
    ref = tmp / "ref"
    out = run_cli(_staged_args(tmp, ref, stages))
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, web, code, stages, ref, step_rows(ref)


@pytest.mark.multiprocess
def test_stage_and_counts_per_row_follow_the_stages(staged):
    tmp, web, code, stages, ref, rows = staged
    assert sorted(rows) == list(range(1, STEPS + 1))
    for step, row in rows.items():
        assert row["samples/web"] + row["samples/code"] == G * step
        last = G * step - 1  # the last sample trained
        assert row["stage"] == (1 if last < 24 else 2 if last < 61 else 3 if last < 80 else 4)
    assert [rows[s]["samples/code"] for s in (1, 2, 3)] == [0, 0, 0]  # web alone for 3 batches
    assert rows[12]["samples/web"] == rows[10]["samples/web"]  # code alone from batch 10 (samples 80..)
    assert [rows[s]["seq_len"] for s in (10, 11, 12)] == [32, 64, 64]
    assert [rows[s]["consumed_tokens"] for s in (10, 11, 12)] == [80 * 32, 80 * 32 + 8 * 64, 80 * 32 + 16 * 64]
    vals = [r for r in metrics_rows(ref) if "val_loss" in r]
    assert [r["step"] for r in vals] == [0, 6, 12]
    for r in vals:  # the overall loss is the token-weighted mean of the two sources' (same token count each)
        assert r["val_loss"] == pytest.approx((r["val_loss/web"] + r["val_loss/code"]) / 2, rel=1e-6)


def _kill_after(args, ready, log):
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=user_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    running = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return running


@pytest.mark.multiprocess
@pytest.mark.parametrize("kill_at, ranks", [(4, 1), (10, 2)])  # inside the ramp stage; exactly at stage 4's start
def test_a_killed_staged_run_resumes_with_the_same_samples(staged, kill_at, ranks):
    """Killed (SIGKILL) once checkpoint kill_at is complete, resumed on one rank (the same batch_crc32 and losses,
    bitwise) or on two (dp_shard 2: the same stages and per-source counts, the curve within the parity tolerance)."""
    tmp, web, code, stages, ref, rows = staged
    run_dir = tmp / f"killed{kill_at}"
    args = _staged_args(tmp, run_dir, stages)
    with open(tmp / f"killed{kill_at}.log", "w") as log:
        assert _kill_after(args, lambda: (checkpoint_dir(run_dir, kill_at) / "COMPLETE").exists(), log)
    if ranks == 1:
        out = run_cli(args)
    else:
        out = run_cli(["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", *args,
                       "--parallel.dp_shard", str(ranks)])
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = step_rows(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    if ranks == 1:
        assert _samples(resumed) == _samples(rows)
        assert {s: r["loss"] for s, r in resumed.items()} == {s: r["loss"] for s, r in rows.items()}
    else:
        assert {s: _samples({0: r})[0][:3] for s, r in resumed.items()} == \
            {s: _samples({0: r})[0][:3] for s, r in rows.items()}
        for s in range(kill_at + 1, STEPS + 1):
            assert resumed[s]["loss"] == pytest.approx(rows[s]["loss"], rel=1e-5), s


@pytest.mark.multiprocess
def test_a_stage_raising_seq_len_resumes_on_cp_and_a_cp_checkpoint_back_on_one_process(staged):
    """Context parallelism across a long-context stage: the one-process reference's checkpoint 10, where stage 4's
    64-token sequences begin (seq_len 32 -> 64), resumed on 4 ranks as cp 2 x dp_shard 2 gives the reference's
    steps 11-12 (losses and the step-12 validation losses within 1e-5, the same stages and per-source samples); a cp
    2 x dp_shard 2 run from checkpoint 8 to the boundary, resumed from its checkpoint 10 on one process, does too,
    with the reference's batch CRCs."""
    tmp, web, code, stages, ref, rows = staged
    want_val = next(r for r in metrics_rows(ref) if r.get("step") == 12 and "val_loss" in r)
    cp = ["--parallel.cp", "2", "--parallel.dp_shard", "2"]
    four = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]

    def check(run_dir, steps, dp=1):
        got = step_rows(run_dir)
        assert sorted(got) == steps, sorted(got)
        # (batch_crc32 is of rank 0's sequences: data-parallel rank 0's half of the batch at dp 2, its cp ranks'
        # alike; the whole batch on one process)
        keep = 4 if dp == 1 else 3
        assert {s: _samples({0: got[s]})[0][:keep] for s in steps} == \
            {s: _samples({0: rows[s]})[0][:keep] for s in steps}
        for s in steps:
            assert got[s]["loss"] == pytest.approx(rows[s]["loss"], rel=1e-5), s
            assert got[s]["consumed_tokens"] == rows[s]["consumed_tokens"]  # (the global batch's, on any layout)
        return got

    boundary = tmp / "cp-from-boundary"
    out = run_cli([*four, *_staged_args(tmp, boundary, stages, "--checkpoint.load", str(checkpoint_dir(ref, 10)), *cp)])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'cp': 2" in out.stdout
    assert [r["seq_len"] for r in check(boundary, [11, 12], dp=2).values()] == [64, 64]
    val = next(r for r in metrics_rows(boundary) if r.get("step") == 12 and "val_loss" in r)
    for key in ("val_loss", "val_loss/web", "val_loss/code"):
        assert val[key] == pytest.approx(want_val[key], rel=1e-5), key
    before = tmp / "cp-to-boundary"
    out = run_cli([*four, *_staged_args(tmp, before, stages, "--checkpoint.load", str(checkpoint_dir(ref, 8)),
                                        "--train.steps", "10", *cp)])
    assert out.returncode == 0, out.stderr[-3000:]
    check(before, [9, 10], dp=2)
    back = tmp / "cp-checkpoint-on-one"
    out = run_cli(_staged_args(tmp, back, stages, "--checkpoint.load", str(checkpoint_dir(before, 10))))
    assert out.returncode == 0, out.stderr[-3000:]
    check(back, [11, 12])


@pytest.mark.multiprocess
def test_changed_stages_are_refused_unless_allowed_then_apply_from_the_resume_point(staged):
    tmp, web, code, stages, ref, rows = staged
    run_dir = tmp / "changed"
    first = run_cli(_staged_args(tmp, run_dir, stages, "--train.steps", "6"))
    assert first.returncode == 0, first.stderr[-3000:]
    before = (run_dir / "metrics.jsonl").read_bytes()
    new = [f"0: 0.5 {web} 0.5 {code}", f"2: {web}"]  # web alone from the resume point (batch 6) on
    refused = run_cli(_staged_args(tmp, run_dir, new))
    assert refused.returncode == 2 and "data.stages: checkpoint" in refused.stderr
    assert refused.stderr.count("\n") == 1 and (run_dir / "metrics.jsonl").read_bytes() == before
    out = run_cli(_staged_args(tmp, run_dir, new, "--checkpoint.allow_data_change", "true", "--train.steps", "10"))
    assert out.returncode == 0, out.stderr[-3000:]
    # a second resume (from step 10) with the new stages, nothing more allowed: the change's origin (batch 6 and
    # the counts there) was saved with the checkpoints after it, so it is accepted and the counts go on
    out = run_cli(_staged_args(tmp, run_dir, new))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in out.stdout and "step 10" in out.stdout.split("resuming from")[1].splitlines()[0]
    after = step_rows(run_dir)
    web6, code6 = rows[6]["samples/web"], rows[6]["samples/code"]
    for s in range(7, STEPS + 1):  # code frozen at its count, web on by G a step
        assert (after[s]["samples/web"], after[s]["samples/code"]) == (web6 + G * (s - 6), code6)
    assert after[7]["stage"] == 2 and "data_change" in [k for r in metrics_rows(run_dir) for k in r]


@pytest.mark.multiprocess
def test_a_source_that_runs_out_stops_the_run_at_start_when_asked(tmp_path, capsys):
    web, code = _source_files(tmp_path, n_docs=(300, 12))
    stages = [f"0: {web}", f"2: {code}"]
    run_dir = tmp_path / "stop"
    run = launcher("pretrain_gpt")
    assert run.cli(_staged_args(tmp_path, run_dir, stages, "--data.source_exhausted", "stop")[1:]) == 2
    err = capsys.readouterr().err
    assert f"data.stages read {code} (seq 32) past its one pass" in err and "--data.source_exhausted wrap" in err
    assert err.count("\n") == 1 and not run_dir.exists()
    # wrapping, a run long enough to read code ~1,000 times over: refused at start (it built a pass each, 4 cache
    # files and 5 open files apiece, and died of "Too many open files"); the count by hand from the pass size
    per_pass = int(err.split("past its one pass (")[1].split(" train samples")[0].replace(",", ""))
    steps = 2 + 1000 * per_pass // G  # web alone for 2 batches, then code alone
    need = -(-(steps - 2) * G // per_pass)
    cache_files = len(list((tmp_path / "cache").rglob("*")))
    assert run.cli(_staged_args(tmp_path, run_dir, stages, "--train.steps", str(steps))[1:]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.stages: {steps:,} batches read {code} (seq 32) {need:,} times over "
                          f"({(steps - 2) * G:,} samples drawn, {per_pass:,} a pass), {need + 1:,} passes in all, "
                          f"each built at start (at most "), err
    assert "add data to it, lower its weight, or train fewer steps (the other streams need 1)" in err
    assert err.count("\n") == 1 and not run_dir.exists()
    assert len(list((tmp_path / "cache").rglob("*"))) == cache_files  # no pass built beyond the first ones


def test_the_planner_plans_the_longest_stage():
    """launch/plan.py (the trainer's resolve) plans the batches of the longest stage: its sequence length and the
    micro-batch that keeps a microbatch's tokens (4 x 2048 = 2 x 4096, a divisor of the rank's 32 samples)."""
    plan = launcher("plan")
    base = ["--model.name", "gpt3-1.3b", "--model.max_seq_len", "4096", "--train.seq_len", "2048",
            "--train.global_batch_size", "512", "--train.micro_batch_size", "4", "--cluster.nodes", "2",
            "--cluster.gpu", "h100", "--parallel.tp", "1"]
    _, cfg, layout, _ = plan.parse(base + ["--data.stages", "0: /data/web,1000 seq 4096: /data/code"])
    assert (cfg.train.seq_len, cfg.train.micro_batch_size, layout.dp) == (4096, 2, 16)
    _, plain, _, _ = plan.parse(base)
    assert (plain.train.seq_len, plain.train.micro_batch_size) == (2048, 4)
    with pytest.raises(ConfigError, match=r"data.stages: seq 8192 exceeds model.max_seq_len=4096"):
        plan.parse(base + ["--data.stages", "0: /data/web,1000 seq 8192: /data/code"])


def test_the_validation_loss_over_sources_is_token_weighted_by_hand():
    """Evaluator.validation over two sources whose targets count unequally (12 of code's 16 are ignored): val_loss is
    the token-weighted mean (a run's sources count alike, so the staged run above cannot tell it from the mean of
    the two), each source's its own mean. The per-token losses by hand: web's logits are flat over 4 entries (ln 4),
    code's put 2.0 on the target (ln(e^2 + 3) - 2)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from hybridpar.inference.in_training import Evaluator
    from hybridpar.training.microbatch import IGNORE_INDEX, StepNumerics, logits_loss

    class Logits(torch.nn.Module):  # token 0 -> flat logits, token 1 -> 2.0 on entry 0
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(2, 4)
            with torch.no_grad():
                self.table.weight.copy_(torch.tensor([[0.0, 0, 0, 0], [2.0, 0, 0, 0]]))

        def forward(self, x):
            return self.table(x)

    web = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    code_y = torch.full((2, 8), IGNORE_INDEX)
    code_y[0, :4] = 0
    code = (torch.ones(2, 8, dtype=torch.long), code_y)
    numerics = StepNumerics(nullcontext, logits_loss, nullcontext, None)
    data = SimpleNamespace(valid_sources={"web": [web], "code": [code]}, valid=[web, code])
    ev = Evaluator(SimpleNamespace(train=SimpleNamespace(compile=False)), Logits(), None, torch.device("cpu"), None,
                   numerics, data, [], lambda t: t, lambda: False)
    got = ev.validation()
    web_loss, code_loss = math.log(4), math.log(math.exp(2) + 3) - 2
    assert got["val_loss/web"] == pytest.approx(web_loss, rel=1e-6)
    assert got["val_loss/code"] == pytest.approx(code_loss, rel=1e-6)
    assert got["val_loss"] == pytest.approx((16 * web_loss + 4 * code_loss) / 20, rel=1e-6)
    assert abs(got["val_loss"] - (web_loss + code_loss) / 2) > 0.1  # the unweighted mean is far off


@pytest.mark.multiprocess
def test_skipped_batches_in_a_staged_run_keep_exact_per_source_counts(staged):
    """data.skip_batches 4-5 in the staged run: step k trains batch k (k <= 3) or k + 2, and each source's count
    is the reference's at that batch less what batches 4-5 drew of it (by hand from the reference's rows)."""
    tmp, web, code, stages, ref, rows = staged
    run_dir = tmp / "skipped"
    out = run_cli(_staged_args(tmp, run_dir, stages, "--data.skip_batches", "4-5", "--train.steps", str(STEPS - 2)))
    assert out.returncode == 0, out.stderr[-3000:]
    got = step_rows(run_dir)

    def counts(step):
        return rows[step]["samples/web"], rows[step]["samples/code"]

    skipped = [a - b for a, b in zip(counts(5), counts(3))]
    assert sum(skipped) == 2 * G
    for k in range(1, STEPS - 1):
        want = counts(k) if k <= 3 else tuple(c - s for c, s in zip(counts(k + 2), skipped))
        assert (got[k]["samples/web"], got[k]["samples/code"]) == want, k
        assert got[k]["batch_crc32"] == rows[k if k <= 3 else k + 2]["batch_crc32"], k  # the same tokens
