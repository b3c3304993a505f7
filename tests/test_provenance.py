"""Provenance (hybridpar/data/provenance.py, launch/provenance.py) against what a run really fed its model: a staged
run with a ramp and a source that wraps into further passes, on 2 data-parallel ranks with a gradient fault that a
spike rewind skips batches for, killed (SIGKILL) after a checkpoint and resumed on 1 rank; every rank's inputs and
targets at every step recorded by tests/feed_recorder.py. The ledger's documents and token ranges, read back from
the sources' .bin files, give exactly the recorded ids; a document's steps equal a brute-force search of them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, kill_job, run_cli, user_env

G, SEQ, STEPS = 8, 32, 16


def _args(tmp, run_dir, web, code):
    stages = f"0: {web},3 ramp 3: 0.5 {web} 0.5 {code},8: 0.25 {web} 0.75 {code}"
    return ["--train.steps", str(STEPS), "--train.global_batch_size", str(G), "--train.seq_len", str(SEQ),
            "--logging.interval", "1", "--train.eval_interval", "0", "--train.sample_tokens", "0",
            "--train.eval_tasks", "", "--train.precision", "fp32", "--checkpoint.interval", "2",
            "--checkpoint.keep_last", "20", "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes",
            "--data.cache_dir", str(tmp / "cache"), "--run.dir", str(run_dir), "--data.stages", stages,
            "--data.source_exhausted", "wrap", "--train.spike", "rewind", "--spike.window", "4", "--spike.skip", "2",
            "--spike.grad_norm_zscore", "6", "--model.n_layers", "1"]


def _fed(directory) -> dict[int, dict[int, tuple]]:
    """step -> dp rank -> (dp size, x rows, y rows): each step's last record in this launch's files."""
    out: dict[int, dict[int, tuple]] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out.setdefault(r["step"], {})[r["dp_rank"]] = (r["dp_size"], r["x"], r["y"])
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from hybridpar.checkpoint.layout import checkpoint_dir
    from test_stages import _source_files

    tmp = tmp_path_factory.mktemp("provenance")
    web, code = _source_files(tmp, n_docs=(300, 12))  # code: ~40 samples a pass, read ~3 times over
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "tests/feed_recorder.py", str(tmp / "fed-2"), "0,7,1000", *_args(tmp, run_dir, web, code)]
    with open(tmp / "run-2.log", "w") as log:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=user_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (checkpoint_dir(run_dir, 12) / "COMPLETE").exists() and agent.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert agent.poll() is None, (tmp / "run-2.log").read_text()[-3000:]
    kill_job(agent)
    out = run_cli(["tests/feed_recorder.py", str(tmp / "fed-1"), "-", *_args(tmp, run_dir, web, code)])
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = _fed(tmp / "fed-2"), _fed(tmp / "fed-1")
    fed = {s: second.get(s) or first[s] for s in range(1, STEPS + 1)}
    log = (tmp / "run-2.log").read_text()
    return tmp, run_dir, web, code, fed, log + out.stdout


def _samples(fed_step) -> list[np.ndarray]:
    """The step's G samples in global order, each as its seq_len + 1 tokens (inputs, then the last target)."""
    out = []
    for rank in sorted(fed_step):
        size, x, y = fed_step[rank]
        assert len(fed_step) == size
        out += [np.array(a + b[-1:]) for a, b in zip(x, y)]
    return out


@pytest.mark.multiprocess
def test_the_ledger_gives_the_ids_every_rank_fed(recorded):
    from hybridpar.data.indexed import IndexedTokens
    from hybridpar.audit import open_ledger

    tmp, run_dir, web, code, fed, log = recorded
    # the run went through what the test is about (said by the run itself)
    assert "rewind 1/3: back to step 4" in log and "batches 6-7 (16 samples) skipped" in log, log[-3000:]
    assert (len(fed[1]), len(fed[16])) == (2, 1)  # 2 ranks, then 1 after the kill
    with open_ledger(run_dir) as ledger:  # (it holds a process group: closed here)
        assert ledger.steps == STEPS and (6, 7) in ledger.windows
        bins = {p: IndexedTokens(p) for p in (web, code)}
        passes = set()
        for step in range(1, STEPS + 1):
            rows = ledger.step(step)
            want = _samples(fed[step])
            assert [r["sample"] for r in rows] == list(range(G))
            for r, ids in zip(rows, want):
                tokens = np.concatenate([bins[r["source"]][d][a:b] for d, a, b in r["documents"]])
                assert np.array_equal(tokens, ids[:len(tokens)]) and len(ids) - len(tokens) == r.get("pad", 0), \
                    (step, r)
                passes.add((r["source"], r["pass"]))
        assert (code, 2) in passes  # the code source wrapped into its second pass


@pytest.mark.multiprocess
def test_a_documents_steps_are_a_brute_force_search_of_the_fed_ids(recorded):
    from hybridpar.data.indexed import IndexedTokens
    from hybridpar.audit import open_ledger

    tmp, run_dir, web, code, fed, _ = recorded
    with open_ledger(run_dir) as ledger:  # (it holds a process group: closed here)
        samples = {(s, k): ids for s in fed for k, ids in enumerate(_samples(fed[s]))}
        for prefix, docs in ((code, range(12)), (web, range(0, 300, 37))):
            data = IndexedTokens(prefix)
            for d in docs:
                doc = data[d]
                # brute force: the (step, sample) whose ids hold a run of >= 4 of the document's tokens at its place
                windows = {tuple(doc[i:i + 4]) for i in range(len(doc) - 3)}
                want = {key for key, ids in samples.items() if any(tuple(ids[i:i + 4]) in windows
                                                                   for i in range(len(ids) - 3))}
                rows = ledger.document(prefix, d)
                got = {(r["step"], r["sample"]) for r in rows if r["stop"] - r["start"] >= 4}
                assert got == want, (prefix, d)
                for r in rows:  # and each range is what that sample holds
                    ids = samples[r["step"], r["sample"]]
                    part = doc[r["start"]:r["stop"]]
                    assert any(np.array_equal(ids[i:i + len(part)], part) for i in range(len(ids) - len(part) + 1))
            assert any(ledger.document(prefix, d) for d in docs)


@pytest.mark.multiprocess
def test_the_command_prints_writes_and_refuses(recorded):
    from hybridpar.checkpoint.layout import checkpoint_dir

    tmp, run_dir, web, code, fed, _ = recorded
    out = run_cli(["launch/provenance.py", str(run_dir), "--step", "6"])
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == G and lines[0].startswith("step 6 sample 0 (position 56): ")  # batches 6-7 skipped
    ledger = tmp / "ledger.jsonl"
    out = run_cli(["launch/provenance.py", str(run_dir), "--steps", "1-16", "--out", str(ledger)])
    assert out.returncode == 0 and out.stdout.strip() == f"wrote {STEPS * G} rows to {ledger}", out.stderr
    rows = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert [(r["step"], r["sample"]) for r in rows] == [(s, k) for s in range(1, STEPS + 1) for k in range(G)]
    out = run_cli(["launch/provenance.py", str(run_dir), "--document", "code:3"])
    assert out.returncode == 0 and out.stdout.strip().endswith("read code:3"), out.stderr
    from hybridpar.data.indexed import IndexedTokens

    data = IndexedTokens(web)
    d = next(d for d in range(37, 300) if len(data[d]) > 60)
    snippet = bytes(data[d][10:40].tolist()).decode()  # (the bytes tokenizer: ids 1-127 are ASCII)
    out = run_cli(["launch/provenance.py", str(run_dir), "--text", snippet])
    assert out.returncode == 0 and out.stdout.startswith(f"--text is in 1 document(s): {web}:{d}\n"), out.stderr
    for argv, message in [
        (["--steps", "1-16", "--out", str(ledger)], f"error: --out {ledger} exists; name a new file"),
        (["--steps", "3-2", "--out", str(tmp / "x.jsonl")], "error: --steps '3-2': give A-B with 1 <= A <= B"),
        (["--step", "17"], "error: --step 17: the run trained steps 1 to 16"),
        (["--document", "code"], "error: --document 'code': give SOURCE:INDEX"),
        (["--document", "docs:1"], "error: --document docs:1: the run reads no source of that name"),
        (["--document", "code:12"], "error: --document code:12: code holds documents 0 to 11"),
        (["--step", "1", "--document", "code:1"], "error: give one of --step S, --steps A-B"),
        (["--step", "0"], "error: --step 0: steps start at 1; give --step 1"),
        (["--steps", "1-2", "--out", str(tmp / "none" / "x.jsonl")],
         f"error: --out {tmp / 'none' / 'x.jsonl'}: directory {tmp / 'none'} does not exist; create it first"),
        (["--text", "abc \udcff"], "error: --text 'abc \\udcff' is not valid UTF-8"),  # (a non-UTF-8 argv byte)
        (["--text", "zq" * 48_000], "error: --text 'zqzq"),
    ]:
        out = run_cli(["launch/provenance.py", str(run_dir), *argv])
        assert out.returncode == 2 and out.stderr.startswith(message) and len(out.stderr.splitlines()) == 1, \
            (argv, out.stderr[:300])
        assert len(out.stderr) < 400, out.stderr[:300]  # (a 96,000-character --text is not echoed whole)
    assert not (tmp / "x.jsonl").exists() and not (tmp / "none").exists()
    out = run_cli(["launch/provenance.py", str(checkpoint_dir(run_dir, 12)), "--step", "1"])
    assert out.returncode == 2 and out.stderr.startswith(f"error: {checkpoint_dir(run_dir, 12)} is a checkpoint"), \
        out.stderr
    out = run_cli(["launch/provenance.py", str(tmp), "--step", "1"])
    assert out.returncode == 2 and out.stderr.startswith(f"error: {tmp} holds no checkpoints/"), out.stderr


@pytest.mark.multiprocess
def test_a_blend_skips_batches_at_start_and_on_a_resume(tmp_path):
    """A blend ("0.3 web 0.7 code", the small code source read several times over) trained 8 steps logs each step's
    batch_crc32 (the reference); a fresh run with --data.skip_batches 3-4 trains batches 1, 2, 5-10 and a resume of
    the reference's step-4 checkpoint with --data.skip_batches 6-7 trains 5, 8, 9, 10: each step's CRC is the
    reference's batch, and the batches past train.steps that both read (9, 10) agree between the two. Its start line
    says how many passes each source is read; data.source_exhausted stop refuses it in one line, writing nothing."""
    from conftest import step_rows
    from hybridpar.checkpoint.layout import checkpoint_dir
    from test_stages import _source_files

    web, code = _source_files(tmp_path, n_docs=(300, 12))
    common = ["--train.steps", "8", "--train.global_batch_size", "8", "--train.seq_len", "32", "--logging.interval",
              "1", "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.eval_tasks", "",
              "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes",
              "--data.cache_dir", str(tmp_path / "cache"), "--data.path", f"0.3 {web} 0.7 {code}",
              "--model.n_layers", "1", "--checkpoint.interval", "4"]

    def crcs(args, run_dir):
        out = run_cli(["launch/pretrain_gpt.py", *common, *args, "--run.dir", str(run_dir)])
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return {s: r["batch_crc32"] for s, r in step_rows(run_dir).items()}, out.stdout

    ref, said = crcs([], tmp_path / "ref")
    assert f"{code}: " in said and " pass(es) over its " in said, said[-2000:]
    skipped, _ = crcs(["--data.skip_batches", "3-4"], tmp_path / "skip")
    resumed, _ = crcs(["--checkpoint.load", str(checkpoint_dir(tmp_path / "ref", 4)), "--data.skip_batches", "6-7"],
                      tmp_path / "resumed")
    assert [skipped[s] for s in (1, 2, 3, 4, 5, 6)] == [ref[b] for b in (1, 2, 5, 6, 7, 8)]
    assert [resumed[s] for s in (5, 6)] == [ref[b] for b in (5, 8)]
    assert [resumed[s] for s in (7, 8)] == [skipped[s] for s in (7, 8)]  # batches 9 and 10, read by both
    assert len(set(skipped.values())) == 8
    out = run_cli(["launch/pretrain_gpt.py", *common, "--data.source_exhausted", "stop", "--run.dir",
                   str(tmp_path / "stop")])
    assert out.returncode != 0 and f"data.path reads {code} past its one pass" in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "stop" / "metrics.jsonl").exists()


def _check_against_fed(ledger, fed, steps, bins):
    for step in steps:
        rows = ledger.step(step)
        assert [r["sample"] for r in rows] == list(range(len(rows)))
        for r, ids in zip(rows, _samples(fed[step])):
            tokens = np.concatenate([bins[r["source"]][d][a:b] for d, a, b in r["documents"]])
            assert np.array_equal(tokens, ids[:len(tokens)]) and len(ids) - len(tokens) == r.get("pad", 0), (step, r)


@pytest.mark.multiprocess
def test_provenance_reads_the_runs_own_record_not_the_files_a_user_edits(tmp_path):
    """A plain source (web) trained 4 steps, then resumed onto a blend of web and code with
    checkpoint.allow_data_change to step 8, every rank's feed recorded: the ledger gives the fed ids of every step,
    each with the data then in force; still after config.yaml is edited (seed, seq_len, data.path) and
    skipped_batches.json says other batches were skipped. The code source re-preprocessed under its prefix: the
    blend's steps are refused in one line naming it (the plain steps still answer), and a resume onto it is refused
    in one line, writing nothing, unless allowed, which the record keeps."""
    from hybridpar.audit import open_ledger
    from hybridpar.data.indexed import IndexedTokens
    from test_stages import _source_files

    web, code = _source_files(tmp_path, n_docs=(300, 12))
    run_dir = tmp_path / "run"
    common = ["--train.global_batch_size", "8", "--train.seq_len", "32", "--logging.interval", "1",
              "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.eval_tasks", "",
              "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes",
              "--data.cache_dir", str(tmp_path / "cache"), "--model.n_layers", "1", "--checkpoint.interval", "4",
              "--run.dir", str(run_dir)]
    out = run_cli(["tests/feed_recorder.py", str(tmp_path / "fed-a"), "-", *common, "--train.steps", "4",
                   "--data.path", web])
    assert out.returncode == 0, out.stderr[-2000:]
    blend = ["--train.steps", "8", "--data.path", f"0.5 {web} 0.5 {code}"]
    out = run_cli(["launch/pretrain_gpt.py", *common, *blend])  # (a change of data, not allowed: refused)
    assert out.returncode == 2 and "checkpoint.allow_data_change" in out.stderr, out.stderr[-2000:]
    out = run_cli(["tests/feed_recorder.py", str(tmp_path / "fed-b"), "-", *common, *blend,
                   "--checkpoint.allow_data_change", "true"])
    assert out.returncode == 0, out.stderr[-2000:]
    fed = {**_fed(tmp_path / "fed-a"), **_fed(tmp_path / "fed-b")}
    assert sorted(fed) == list(range(1, 9))
    bins = {p: IndexedTokens(p) for p in (web, code)}

    def ledgered():
        with open_ledger(run_dir) as ledger:
            assert ledger.steps == 8 and [(p.first, p.last) for p in ledger.parts] == [(0, 4), (4, 8)]
            _check_against_fed(ledger, fed, range(1, 9), bins)
            assert {r["source"] for s in (5, 6, 7, 8) for r in ledger.step(s)} == {web, code}

    ledgered()
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("seed: 1234", "seed: 99").replace("seq_len: 32", "seq_len: 16")
                      .replace(f"path: 0.5 {web} 0.5 {code}", f"path: {code}"))
    (run_dir / "skipped_batches.json").write_text('{"windows": [[2, 3]], "rewinds": 1}')
    ledgered()
    # The code source preprocessed again under its prefix (other documents)
    _source_files(tmp_path / "again", n_docs=(3, 12), seed=5)
    for ext in (".bin", ".idx"):
        (tmp_path / "again" / f"code{ext}").replace(f"{code}{ext}")
    out = run_cli(["launch/provenance.py", str(run_dir), "--step", "6"])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: --step 6: steps 5 to 8 read sources that changed on disk since ({code}: "), \
        out.stderr
    assert run_cli(["launch/provenance.py", str(run_dir), "--step", "2"]).returncode == 0
    out = run_cli(["launch/provenance.py", str(run_dir), "--document", "code:1"])
    assert out.returncode == 2 and "cannot be known" in out.stderr, out.stderr
    before = (run_dir / "metrics.jsonl").read_bytes()
    out = run_cli(["launch/pretrain_gpt.py", *common, *blend[:1], "10", *blend[2:]])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
    assert f"a data source changed on disk since the run read it ({code}: " in out.stderr, out.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    allowed = ["launch/pretrain_gpt.py", *common, *blend[:1], "10", *blend[2:], "--checkpoint.allow_data_change",
               "true"]
    out = run_cli(allowed)  # the trainer does not believe the edited skipped_batches.json either
    assert out.returncode == 2 and out.stderr.strip() == (
        f"error: {run_dir / 'skipped_batches.json'} records skipped batches 2-3, which the checkpoint (step 8, batch "
        f"8) trained: the file belongs to another history; delete it to resume with the checkpoint's own skipped "
        f"batches"), out.stderr[-2000:]
    assert (run_dir / "metrics.jsonl").read_bytes() == before
    (run_dir / "skipped_batches.json").write_text('{"windows": [[9, 100000000000000000000]], "rewinds": 1}')
    out = run_cli(allowed)
    assert out.returncode == 2 and out.stderr.startswith(
        f"error: {run_dir / 'skipped_batches.json'} records skipped batches 9-100000000000000000000, past batch ") \
        and "the last this run's rewinds can reach" in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
    (run_dir / "skipped_batches.json").unlink()
    out = run_cli(allowed)
    assert out.returncode == 0, out.stderr[-2000:]
    from hybridpar.checkpoint.dcp import read_trainer_state
    from hybridpar.checkpoint.layout import checkpoint_dir
    from hybridpar.data.record import of_tensor

    record = of_tensor(read_trainer_state(checkpoint_dir(run_dir, 8))["data_record"], "step 8")
    assert [(s["from_step"], s["allowed_change"]) for s in record] == [(0, False), (4, True)]
    record = of_tensor(read_trainer_state(checkpoint_dir(run_dir, 10))["data_record"], "step 10")
    assert [(s["from_step"], s["allowed_change"]) for s in record] == [(0, False), (4, True), (8, True)]


@pytest.mark.multiprocess
def test_a_run_whose_stages_changed_is_ledgered_with_each_segments_stages(tmp_path):
    """A staged run (web, then a ramp to half code) trained 6 steps, resumed to 10 with other stages (a blend
    from batch 0, web alone from batch 2: web alone from the resume point on) under checkpoint.allow_data_change: every step's ledgered ids are the ids the rank
    fed, each segment with its own stages; a changed-stage resume without the allowance is refused first."""
    from hybridpar.audit import open_ledger
    from hybridpar.data.indexed import IndexedTokens
    from test_stages import _source_files

    web, code = _source_files(tmp_path, n_docs=(300, 300))
    run_dir = tmp_path / "run"
    common = ["--train.global_batch_size", "8", "--train.seq_len", "32", "--logging.interval", "1",
              "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.eval_tasks", "",
              "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes",
              "--data.cache_dir", str(tmp_path / "cache"), "--model.n_layers", "1", "--checkpoint.interval", "2",
              "--run.dir", str(run_dir)]
    first = ["--train.steps", "6", "--data.stages", f"0: {web},3 ramp 3: 0.5 {web} 0.5 {code}"]
    out = run_cli(["tests/feed_recorder.py", str(tmp_path / "fed-a"), "-", *common, *first])
    assert out.returncode == 0, out.stderr[-2000:]
    second = ["--train.steps", "10", "--data.stages", f"0: 0.5 {web} 0.5 {code},2: {web}"]
    out = run_cli(["launch/pretrain_gpt.py", *common, *second])
    assert out.returncode == 2 and "data.stages: checkpoint" in out.stderr, out.stderr[-2000:]
    out = run_cli(["tests/feed_recorder.py", str(tmp_path / "fed-b"), "-", *common, *second,
                   "--checkpoint.allow_data_change", "true"])
    assert out.returncode == 0, out.stderr[-2000:]
    fed = {**_fed(tmp_path / "fed-a"), **_fed(tmp_path / "fed-b")}
    assert sorted(fed) == list(range(1, 11))
    with open_ledger(run_dir) as ledger:
        assert ledger.steps == 10 and [(p.first, p.last) for p in ledger.parts] == [(0, 6), (6, 10)]
        _check_against_fed(ledger, fed, range(1, 11), {p: IndexedTokens(p) for p in (web, code)})
        assert {r["source"] for r in ledger.step(2)} == {web}  # the first stages' web-only start
        assert {r["source"] for s in (7, 8, 9, 10) for r in ledger.step(s)} == {web}  # the new stage 2: web alone
