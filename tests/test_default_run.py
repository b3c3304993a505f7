"""The default run end to end, as a user types it (fewer steps), and its determinism."""

from __future__ import annotations

import pytest
from conftest import loss_curve, metrics_rows, run_cli


def test_default_run_learns_and_writes_its_files(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = ["launch/pretrain_gpt.py", "--train.steps", "40", "--train.eval_interval", "20", "--logging.interval", "5",
            "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir), "--train.sample_tokens", "20"]
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics_rows(run_dir)
    train = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(5, 41, 5))
    assert [r["step"] for r in val] == [0, 20, 40]
    for r in train:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_sec", "consumed_tokens"} <= set(r)
        assert r["consumed_tokens"] == r["step"] * 32 * 128 and r["tokens_per_sec"] > 0
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 1.0  # it learns
    baseline = float(out.stdout.split("unigram baseline ")[1].split()[0])
    assert val[0]["val_loss"] > baseline  # an untrained model is worse than unigram statistics
    assert "sample (temperature 0.8):" in out.stdout and "step 40/40" in out.stdout
    # The built-in downstream task, at the first and last step (docs/evaluation.md): four choices, 400 examples.
    tasks = [r for r in rows if "eval/next-words/acc" in r]
    assert [r["step"] for r in tasks] == [0, 40]
    for r in tasks:
        assert r["eval/next-words/examples"] == 400 and r["eval/next-words/chance"] == 0.25
        assert 0 <= r["eval/next-words/acc"] <= 1 and 0 <= r["eval/next-words/acc_norm"] <= 1
    assert "eval step 40 | next-words acc" in out.stdout
    assert (run_dir / "tokenizer.json").is_file()

    # The resolved config reproduces the run exactly (same seed, same data order, same losses).
    again = tmp_path / "again"
    out2 = run_cli(["launch/pretrain_gpt.py", "--config", str(run_dir / "config.yaml"), "--run.dir", str(again),
                    "--train.steps", "10"])
    assert out2.returncode == 0, out2.stderr[-3000:]
    first10, again10 = ({s: v for s, v in loss_curve(d).items() if s <= 10} for d in (run_dir, again))
    assert again10 != {}
    # The LR schedule depends on train.steps, so compare the warmup steps, where it does not.
    both = again10.keys() & first10.keys()
    assert {s: again10[s] for s in both} == {s: first10[s] for s in both}

    # An existing run is never clobbered by mistake.
    out3 = run_cli(args)
    assert out3.returncode == 2 and "already holds a run" in out3.stderr and "Traceback" not in out3.stderr


def test_tokenizer_larger_than_model_vocab_is_refused(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    out = run_cli(["launch/pretrain_gpt.py", "--model.vocab_size", "1024", "--data.cache_dir", str(cache_dir),
                   "--run.dir", str(run_dir)])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "has 4096 tokens but model.vocab_size=1024; set --model.vocab_size 4096" in out.stderr
    assert not run_dir.exists()


pytestmark = pytest.mark.multiprocess  # every test here starts processes
