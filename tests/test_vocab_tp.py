"""The layout never changes the model's vocabulary: a vocabulary that tp does not divide is sharded unevenly (ceil(V /
tp) rows a rank, as torch.chunk splits it), never padded for the layout. 257 rows (a prime) divide by no tp > 1.

Real launcher runs (gloo ranks): tp 3 and tp 4 from step 1 against one process (losses, validation, task scores and
the sampled text), and one run carried from tp 1 to tp 3 to tp 2 through its checkpoints."""

from __future__ import annotations

import re
import shutil

import pytest

from conftest import loss_curve, metrics_rows, run_cli

SHAPE = ["--model.d_model", "96", "--model.n_heads", "12", "--model.n_layers", "2", "--model.vocab_size", "257",
         "--data.tokenizer", "bytes", "--train.seq_len", "48", "--train.global_batch_size", "8",
         "--train.micro_batch_size", "2", "--train.precision", "fp32", "--logging.interval", "1",
         "--logging.wandb.mode", "disabled", "--train.sample_tokens", "24", "--train.eval_interval", "3",
         "--train.eval_batches", "2", "--train.eval_tasks_interval", "3", "--train.eval_tasks_batch_size", "4",
         "--checkpoint.interval", "2", "--checkpoint.keep_last", "3"]


def _run(tmp_path, cache_dir, name, nproc, steps, extra=()):
    from test_evaluate import write_tasks

    tasks = write_tasks(tmp_path) if not (tmp_path / "mc.jsonl").exists() else {
        k: tmp_path / f"{k}.jsonl" for k in ("mc", "cloze", "text")}
    args = [*SHAPE, "--train.steps", str(steps), "--data.cache_dir", str(cache_dir), "--run.dir", str(tmp_path / name),
            "--train.eval_tasks", ",".join(str(p) for p in tasks.values()), *extra]
    cmd = ["launch/pretrain_gpt.py", *args]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *cmd]
    out = run_cli(cmd)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "model vocab 257" in out.stdout, out.stdout
    return out.stdout


def _evals(run_dir) -> dict:
    """(step, key) -> value of every validation and task row."""
    return {(r["step"], k): v for r in metrics_rows(run_dir) if "loss" not in r for k, v in r.items()
            if k.startswith(("val_loss", "eval/")) and not k.endswith("seconds")}


def _sample(stdout: str) -> str:
    return re.split(r"sample \(temperature [0-9.]+\):\n", stdout)[1].split("\ndone:")[0]


def _close(got: dict, want: dict, rtol=1e-5) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert abs(got[k] - w) <= rtol * max(abs(w), 1e-6), (k, got[k], w)


@pytest.mark.multiprocess
def test_tp_that_does_not_divide_the_vocabulary_trains_the_single_process_model(tmp_path, cache_dir):
    ref_out = _run(tmp_path, cache_dir, "ref", 1, 6)
    ref, ref_evals, ref_sample = loss_curve(tmp_path / "ref"), _evals(tmp_path / "ref"), _sample(ref_out)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and ("eval/mc/acc" in {k for _, k in ref_evals})
    assert len(ref_sample) > 20

    # tp 3 (86, 86, 85 rows; with sequence parallelism) for the whole run, tp 4 (65, 65, 65, 62; without) for three
    # steps: from step 1 the same curve, validation losses and task scores, and (tp 3) the same sampled text
    for name, nproc, steps, extra in (("tp3", 3, 6, ["--parallel.tp", "3"]),
                                      ("tp4", 4, 3, ["--parallel.tp", "4", "--parallel.sequence_parallel", "false"])):
        out = _run(tmp_path, cache_dir, name, nproc, steps, extra)
        assert f"'tp': {extra[1]}" in out
        _close(loss_curve(tmp_path / name), {s: v for s, v in ref.items() if s <= steps})
        _close(_evals(tmp_path / name), {k: v for k, v in ref_evals.items() if k[0] <= steps})
        if steps == 6:
            assert _sample(out) == ref_sample

    # tp 1 (steps 1-2) -> tp 3 (3-4) -> tp 2 (5-6): the curve goes on as if never stopped
    shutil.copytree(tmp_path / "ref" / "checkpoints" / "step_00000002", tmp_path / "start")
    _run(tmp_path, cache_dir, "moved", 3, 4, ["--parallel.tp", "3", "--checkpoint.load", str(tmp_path / "start")])
    out = _run(tmp_path, cache_dir, "moved", 2, 6, ["--parallel.tp", "2"])
    _close({s: v for s, v in loss_curve(tmp_path / "moved").items()}, {s: v for s, v in ref.items() if s >= 3})
    # (the first leg's last step, 4, evaluates too: the reference has no row there)
    _close({k: v for k, v in _evals(tmp_path / "moved").items() if k[0] in (3, 6)},
           {k: v for k, v in ref_evals.items() if k[0] in (3, 6)})
    assert _sample(out) == ref_sample  # sampled on tp 2 (129, 128 rows) at step 6, as one process
