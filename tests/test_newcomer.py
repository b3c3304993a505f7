"""What a newcomer does, run as they would run it: the same command twice, their own tokenizer, a signal in a slow
step, an export for transformers, a pipe into head, a log file. Each test starts the real command line."""

from __future__ import annotations

import hashlib
import math
import os
import signal
import subprocess
import sys
import time

import yaml

import pytest
from conftest import ROOT, run_cli

TRAIN = str(ROOT / "launch" / "pretrain_gpt.py")
SMALL = ["--train.eval_interval", "0", "--train.sample_tokens", "0", "--logging.interval", "5",
         "--logging.wandb.mode", "disabled"]


def _tree(d):
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def test_same_command_continues_the_run_and_a_finished_run_is_left_alone(tmp_path, cache_dir):
    cmd = [TRAIN, *SMALL, "--train.steps", "6", "--checkpoint.interval", "3", "--data.cache_dir", str(cache_dir)]
    first = run_cli(cmd, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"  # stable: named after the model, no timestamp
    assert (run_dir / "checkpoints" / "step_00000006" / "COMPLETE").is_file()
    # Start-up phases with their times, in order, before the first step's line.
    out = first.stdout
    marks = ["start-up: data ready in", "start-up: model built on the meta device", "start-up: this rank's shards",
             "step 1: first step done in", "step 5/6"]
    assert all(m in out for m in marks) and [out.index(m) for m in marks] == sorted(out.index(m) for m in marks)
    assert "train.steps x global batch needs 192" in out  # 6 steps x 32: why the sample count is what it is

    longer = run_cli([*cmd[:-4], "--train.steps", "9", "--checkpoint.interval", "3", "--data.cache_dir",
                      str(cache_dir)], cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert f"resuming from {os.path.join('runs', 'tiny', 'checkpoints', 'step_00000006')} (step 6" in longer.stdout
    steps = [yaml.safe_load(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 6, 9]  # rows 5 and 6 from the first start, 9 from the second (logging every 5 + the last)

    # The run's own config.yaml passed back with fewer steps: said, nothing touched.
    before = _tree(run_dir)
    back = run_cli([TRAIN, "--config", str(run_dir / "config.yaml"), "--train.steps", "4"], cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-3000:]
    assert "already at step 9" in back.stdout and "train.steps=4" in back.stdout and "done:" not in back.stdout
    assert _tree(run_dir) == before
    # Another model pointed at the same run: refused, with the way out.
    other = run_cli([*cmd, "--model.n_layers", "2"], cwd=tmp_path)
    assert other.returncode == 2 and "--run.name" in other.stderr and "n_layers: checkpoint 4 vs now 2" in other.stderr
    assert _tree(run_dir) == before
    # A config file names its run.
    (tmp_path / "mine.yaml").write_text("train:\n  steps: 2\n")
    mine = run_cli([TRAIN, "--config", "mine.yaml", *SMALL, "--data.cache_dir", str(cache_dir)], cwd=tmp_path)
    assert mine.returncode == 0 and (tmp_path / "runs" / "mine" / "metrics.jsonl").is_file(), mine.stderr[-2000:]


def test_vocabulary_comes_from_the_tokenizer(tmp_path, cache_dir):
    for extra, multiple in [([], 128), (["--model.vocab_multiple", "1"], 1)]:
        run_dir = tmp_path / f"v{multiple}"
        out = run_cli([TRAIN, *SMALL, "--train.steps", "1", "--data.tokenizer", "train-bpe:1000", "--run.dir",
                       str(run_dir), "--data.cache_dir", str(cache_dir), *extra])
        assert out.returncode == 0, out.stderr[-3000:]
        n = int(out.stdout.split("tokenizer train-bpe:1000 (")[1].split()[0])  # the tokenizer's own count
        vocab = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["vocab_size"]
        assert vocab == multiple * math.ceil(n / multiple) and f"model vocab {vocab})" in out.stdout
    assert vocab == n  # vocab_multiple 1 keeps it exact


def test_signal_in_a_slow_step_stops_after_the_microbatch_without_a_checkpoint(tmp_path, cache_dir):
    # 64 microbatches per step; the signal lands in the second step (the first has printed its line).
    run_dir = tmp_path / "slow"
    env = {**os.environ, "SLURM_JOB_ID": "4242"}
    proc = subprocess.Popen([sys.executable, TRAIN, *SMALL, "--train.steps", "50", "--train.global_batch_size", "64",
                             "--train.micro_batch_size", "1", "--run.dir", str(run_dir), "--data.cache_dir",
                             str(cache_dir)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines = []
    for line in proc.stdout:  # read until the first step's line
        lines.append(line)
        if "first step done" in line:
            break
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    rest, stderr = proc.communicate(timeout=300)
    stdout = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "warning: SLURM job 4242 runs with checkpoint.interval 0" in stdout
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM in step 2, after microbatch ") and "nothing saved" in last, stderr
    done = int(last.split("after microbatch ")[1].split()[0])
    assert 1 <= done < 64  # mid-step, not at its end
    assert not (run_dir / "PREEMPTED").exists() and not (run_dir / "checkpoints").exists()


def test_to_hf_writes_the_runs_special_ids_and_tokenizer(tmp_path, cache_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = tmp_path / "run"
    out = run_cli([TRAIN, *SMALL, "--train.steps", "2", "--checkpoint.interval", "2", "--run.dir", str(run_dir),
                   "--data.cache_dir", str(cache_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    from tokenizers import Tokenizer

    eod = Tokenizer.from_file(str(run_dir / "tokenizer.json")).token_to_id("<|endoftext|>")  # the run's own id
    hf = tmp_path / "hf"
    conv = subprocess.run([sys.executable, "launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(run_dir),
                           "--out", str(hf)], cwd=ROOT, capture_output=True, text=True,
                          preexec_fn=lambda: os.umask(0o002))
    assert conv.returncode == 0, conv.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert eod != 50256 and tok.eos_token_id == eod and tok.pad_token_id == eod
    assert model.config.eos_token_id == eod and model.generation_config.eos_token_id == eod
    assert tok.decode(tok("The language of Python")["input_ids"]) == "The language of Python"
    modes = {p.name: p.stat().st_mode & 0o777 for p in hf.iterdir()}
    assert set(modes.values()) == {0o664}, modes  # every file, weights included, follows the umask


def test_small_things(tmp_path):
    piped = subprocess.run("set -o pipefail; python launch/model_zoo.py --json | head -1", shell=True, cwd=ROOT,
                           capture_output=True, text=True, executable="/bin/bash")
    assert piped.returncode == 0 and piped.stdout == "[\n" and "Traceback" not in piped.stderr, piped.stderr
    for script, default in [("train_tokenizer.py", "(default: 32000)"), ("preprocess_data.py", "(default: 1)")]:
        out = run_cli([f"launch/{script}", "--help"])
        words = " ".join(out.stdout.split())  # argparse wraps to the terminal's width
        assert out.returncode == 0 and default in words and "(default: text)" in words, out.stdout
    # Progress written to a log file (not a terminal): whole lines, no carriage returns.
    src = tmp_path / "in.jsonl"
    src.write_text("".join('{"text": "line %d of some text"}\n' % i for i in range(2000)))
    with open(tmp_path / "log", "w") as log:
        subprocess.run([sys.executable, "launch/preprocess_data.py", "--input", str(src), "--tokenizer", "bytes",
                        "--output-prefix", str(tmp_path / "out")], cwd=ROOT, stdout=log, stderr=log, check=True)
    text = (tmp_path / "log").read_text()
    assert "\r" not in text and "2000 documents" in text.replace(",", ""), text


pytestmark = pytest.mark.multiprocess  # every test here starts processes
