"""hybridpar.resolve: one pass from the user's config to a frozen Run, in the order docs/training.md writes down."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from hybridpar.config.cli import dump_yaml, load_config
from hybridpar.errors import ConfigError, RunDirError
from hybridpar.parallel.distributed import WorldInfo
from hybridpar.planning.cost import GIB, GPUS, memory, plan_of
from hybridpar.planning.layouts import refuse_if_too_big
from hybridpar.resolve import resolve

CPU = torch.device("cpu")


class _Vocabulary:
    def __init__(self, n: int):
        self.vocab_size, self.spec = n, f"{n} tokens"


def test_tp3_trains_the_vocabulary_of_one_process(cache_dir):
    """The layout never changes the vocabulary: the built-in 4096-token BPE trains 4096 rows at tp 3 too (sharded
    1366, 1365, 1365), where the old rule (a multiple of 128 x tp) made 4224 of them, another model."""
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--parallel.tp", "3", "--model.n_heads", "3",
                       "--model.d_model", "192", "--train.seq_len", "96", "--train.global_batch_size", "4"])
    run = resolve(cfg, WorldInfo(0, 3, 0, 3), CPU)
    assert run.cfg.model.vocab_size == 4096 and run.tokenizer.vocab_size == 4096
    assert run.layout.degrees == (1, 1, 1, 3) and run.cfg.train.micro_batch_size == 4


def test_every_derived_value_is_filled_and_the_result_is_frozen(cache_dir):
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--train.global_batch_size", "16",
                       "--train.micro_batch_size", "2"])
    run = resolve(cfg, WorldInfo(0, 4, 0, 4), CPU)
    c = run.cfg
    assert (c.run.name, c.run.dir, str(run.run_dir)) == ("tiny", "runs/tiny", "runs/tiny")
    assert (c.parallel.dp_replicate, c.parallel.dp_shard, c.parallel.tp) == (1, 4, 1)
    assert c.train.precision == "fp32" and c.model.vocab_size == 4096 and run.microbatches == 2  # 16 / (2 x 4)
    assert c.parallel.accumulate_unsharded in (True, False)  # "auto" is decided
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.train.steps = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.vocab_size = 1
    assert cfg.train.micro_batch_size == 2 and cfg.run.dir is None  # the user's config is untouched


def test_resume_takes_the_checkpoints_wandb_id_and_the_lock(tmp_path, cache_dir):
    step = tmp_path / "run" / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text("step 4\n")
    (step / "run_state.json").write_text(json.dumps({"wandb_id": "abc123", "cpu_threads": 2}))
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--run.dir", str(tmp_path / "run")])
    run = resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    try:
        assert run.load_from == step and run.cfg.logging.wandb.id == "abc123" and run.run_state["cpu_threads"] == 2
        assert (tmp_path / "run" / ".lock").is_file()
        with pytest.raises(RunDirError):  # a second start on the same run dir, while this one holds it
            resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    finally:
        run.lock.release()
    weights = load_config(["--data.cache_dir", str(cache_dir), "--checkpoint.load", str(step),
                           "--checkpoint.load_weights_only", "true", "--run.dir", str(tmp_path / "new")])
    run = resolve(weights, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    run.lock.release()
    assert run.load_from == step and run.cfg.logging.wandb.id is None  # a new run: a new W&B run


def test_the_refusal_hint_is_a_command_that_fits():
    """The flags the memory refusal names, given back to the config, resolve to a layout the planner fits."""
    argv = ["--model.name", "gpt3-1.3b", "--train.seq_len", "2048", "--train.global_batch_size", "64",
            "--train.precision", "bf16", "--model.vocab_from_tokenizer", "false"]
    world, usable = WorldInfo(0, 16, 0, 8), 15 * GIB
    run = resolve(load_config([*argv, "--train.micro_batch_size", "4", "--parallel.fsdp_strategy", "shard_grad_op"]),
                  world, torch.device("meta"), tokenizer=_Vocabulary(50304), gpu=GPUS["h100"])
    with pytest.raises(ConfigError) as e:
        refuse_if_too_big(run.cfg, run.layout, usable, 8, GPUS["h100"], "a 15 GiB GPU")
    flags = re.search(r"fits: (--.*?) \(\d+\.\d GiB\)", str(e.value)).group(1).split()
    fixed = resolve(load_config([*argv, *flags]), world, torch.device("meta"), tokenizer=_Vocabulary(50304),
                    gpu=GPUS["h100"])
    assert memory(plan_of(fixed.cfg, fixed.layout))["total_bytes_per_gpu"] <= usable
    refuse_if_too_big(fixed.cfg, fixed.layout, usable, 8, GPUS["h100"], "a 15 GiB GPU")  # no error


def test_imports_run_downward():
    """The package layout is the architecture: each part imports only parts below it (errors and the models zoo at
    the bottom, the trainer and the interop converters at the top)."""
    import ast

    from conftest import ROOT

    order = {"errors": 0, "models": 0, "config": 1, "data": 2, "parallel": 2, "metrics": 2, "training": 3,
             "planning": 4, "checkpoint": 4, "resolve": 5, "inference": 6, "audit": 6, "trainer": 7, "session": 8, "interop": 8}
    upward = []
    for path in sorted((ROOT / "hybridpar").rglob("*.py")):
        part = path.relative_to(ROOT / "hybridpar").parts[0].removesuffix(".py")
        if part == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridpar."):
                other = node.module.split(".")[1]
                if other != part and order[other] >= order[part]:
                    upward.append(f"{path.relative_to(ROOT)} imports hybridpar.{other}")
    assert upward == [] and set(order) >= {p.name.removesuffix(".py") for p in (ROOT / "hybridpar").iterdir()
                                           if p.name not in ("__init__.py", "__pycache__")}


def _killed_before_first_checkpoint(run_dir, interval: int) -> None:
    """What a run leaves when it is killed before its first checkpoint completes: its config and some metrics."""
    cfg = load_config(["--checkpoint.interval", str(interval), "--run.dir", str(run_dir)])
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3}\n')
    (run_dir / "checkpoints" / "step_00000005").mkdir(parents=True)  # a save cut off: no COMPLETE marker


def test_a_run_stopped_before_its_first_checkpoint_starts_again(tmp_path, cache_dir):
    """A requeued job runs the same command again: with checkpoints on and none complete, it starts over; a run dir
    whose run saved none is still refused, with the reason that is true."""
    _killed_before_first_checkpoint(tmp_path / "a", 5)
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--checkpoint.interval", "5", "--run.dir", str(tmp_path / "a")])
    run = resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    run.lock.release()
    assert run.load_from is None
    _killed_before_first_checkpoint(tmp_path / "b", 0)
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--run.dir", str(tmp_path / "b")])
    with pytest.raises(ConfigError, match=r"without a checkpoint to continue from: its run saved none "
                                          r"\(checkpoint.interval 0\)"):
        resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    assert not (tmp_path / "b" / ".lock").exists()  # a refused start leaves no lock


@pytest.mark.multiprocess
def test_the_same_command_restarts_a_run_killed_before_its_first_checkpoint(tmp_path, cache_dir):
    from conftest import loss_curve, run_cli

    run_dir = tmp_path / "run"
    _killed_before_first_checkpoint(run_dir, 5)
    args = ["launch/pretrain_gpt.py", "--checkpoint.interval", "5", "--train.steps", "2", "--train.eval_interval", "0",
            "--train.sample_tokens", "0", "--logging.interval", "1", "--logging.wandb.mode", "disabled",
            "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)]
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stopped before its first checkpoint: starting it again from step 0" in out.stdout
    assert sorted(loss_curve(run_dir)) == [1, 2] and loss_curve(run_dir)[1] != 8.3  # the old row is gone


def test_a_sample_count_the_data_layer_cannot_index_is_refused_at_once(tmp_path, cache_dir):
    """train.steps x global batch whose sample index would not fit memory: one line before the data layer starts
    (it looped in megatron-core's epoch count at 1e20 steps and allocated 6.8 GiB then raised at 1e8), and the run
    dir the start would have created is gone again. Hand count: 8 GiB / 12 bytes / 32 = 22,369,621 steps."""
    for steps in ("99999999999999999999", "100000000"):
        cfg = load_config(["--data.cache_dir", str(cache_dir), "--train.steps", steps, "--run.dir",
                           str(tmp_path / "run")])
        with pytest.raises(ConfigError, match=rf"^train.steps={steps} = .* samples, whose index would take .* GiB of "
                                              r"every rank's memory \(at most 8 GiB\); use --train.steps 22369621 or "
                                              r"fewer$"):
            resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
        assert not (tmp_path / "run").exists()
    # huge rewind settings (spike.skip) are what is named, not train.steps: 100 steps + 3 x 10^8 batches
    rewinds = ["--train.spike", "rewind", "--checkpoint.interval", "10", "--spike.skip", "100000000"]
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--train.steps", "100", *rewinds])
    with pytest.raises(ConfigError, match=r"^train.steps=100 \+ spike.max_rewinds=3 x spike.skip=100000000 \(the "
                                          r"batches rewinds may skip\) = 300,000,100 batches x .*; lower "
                                          r"spike.max_rewinds x spike.skip to 22369521 or less$"):
        resolve(cfg, WorldInfo(0, 1, 0, 1), CPU)
    ok = load_config(["--data.cache_dir", str(cache_dir), "--train.steps", "22369621"])
    assert resolve(ok, WorldInfo(0, 1, 0, 1), CPU).cfg.train.steps == 22369621
    # A validation set held in memory past 2 GiB (it was minutes of silent reading): by hand, a batch of 32 x 128
    # tokens as int64 inputs and targets is 65,536 bytes, so 2 GiB holds 32,768 batches.
    for batches, refused in [("100000", True), ("32769", True), ("32768", False)]:
        cfg = load_config(["--data.cache_dir", str(cache_dir), "--train.eval_batches", batches])
        if refused:
            with pytest.raises(ConfigError, match=rf"^train.eval_batches={int(batches):,} x "
                                                  r"train.global_batch_size=32 x train.seq_len=128 is a validation "
                                                  r"set of .* GiB held in memory .*; use --train.eval_batches 32768 "
                                                  r"or fewer$"):
                resolve(cfg, WorldInfo(0, 1, 0, 1), CPU)
        else:
            assert resolve(cfg, WorldInfo(0, 1, 0, 1), CPU).cfg.train.eval_batches == 32768


def test_stray_entries_in_checkpoints_are_not_saves(tmp_path, cache_dir):
    """A user's step_*.bak copy, a step_final, an incomplete step_*.old: none is a save (each crashed every start
    on its name), and the latest real one is resumed."""
    root = tmp_path / "run" / "checkpoints"
    for name, complete in [("step_00000004", True), ("step_00000004.bak", True), ("step_final", True),
                           ("step_00000002.old", False), ("step_00000006", False)]:
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "COMPLETE").write_text("step 4\n")
    (root / "step_00000009").write_text("a file, not a save\n")
    cfg = load_config(["--data.cache_dir", str(cache_dir), "--run.dir", str(tmp_path / "run")])
    run = resolve(cfg, WorldInfo(0, 1, 0, 1), CPU, own_run_dir=True)
    run.lock.release()
    assert run.load_from == root / "step_00000004"


# Each config field that a component reads, set away from its default, and where the component shows it (`t` the
# Trainer start-up built, after one train_step; `before` its weights before it; `torch` imported): the value a
# broken hand-over would lose.
ARRIVALS = [
    (["--optim.lr", "0.002", "--optim.warmup_steps", "0"], "t.optimizer.param_groups[0]['lr']", 0.002),
    (["--optim.beta1", "0.85", "--optim.beta2", "0.97"], "list(t.optimizer.param_groups[0]['betas'])", [0.85, 0.97]),
    (["--optim.eps", "1e-07"], "t.optimizer.param_groups[0]['eps']", 1e-07),
    (["--optim.weight_decay", "0.05"], "sorted({g['weight_decay'] for g in t.optimizer.param_groups})", [0.0, 0.05]),
    (["--optim.fused", "false", "--optim.foreach", "true"], "all(g['foreach'] for g in t.optimizer.param_groups)",
     True),
    (["--optim.name", "muon", "--optim.muon_momentum", "0.9", "--optim.muon_nesterov", "false", "--optim.muon_ns_steps",
      "3", "--optim.muon_scale", "original"],
     "[t.optimizer.param_groups[0][k] for k in ('momentum', 'nesterov', 'ns_steps', 'scale')]",
     [0.9, False, 3, "original"]),
    (["--optim.name", "muon", "--optim.lr", "0.002", "--optim.muon_lr", "0.05", "--optim.warmup_steps", "0"],
     "[g['lr'] for g in t.optimizer.param_groups[:2]]", [0.05, 0.002]),
    (["--optim.name", "muon", "--optim.muon_distribution", "gather"], "t.optimizer.distribution", "gather"),
    (["--train.micro_batch_size", "2"], "[t.run.microbatches, len(t.data.train.microbatches(1))]", [4, 4]),
    (["--train.seq_len", "32"], "list(t.data.train.microbatches(1)[0][0].shape)", [8, 32]),
    (["--train.eval_batches", "3"], "len(t.data.valid)", 3),
    (["--train.activation_checkpointing", "full"], "type(t.model.layers[0]).__name__", "CheckpointWrapper"),
    (["--train.compile", "true"], "t.model.layers[0]._compiled_call_impl is not None", True),
    (["--train.loss_chunk_tokens", "64"], "t.numerics.forward_loss.keywords['chunk_tokens']", 64),
    (["--model.n_layers", "3", "--model.d_model", "48", "--model.n_heads", "3"],
     "[len(t.model.layers), t.model.tok_embeddings.weight.shape[1], t.model.layers[0].attn.head_dim]", [3, 48, 16]),
    (["--train.deterministic", "true", "--train.tf32", "true"],
     "[torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32]", [True, True]),
    (["--train.eval_tasks", ""], "t.evaluator.tasks", []),
    # clipped to a norm of 1e-9, far below AdamW's eps (1e-8), the first step moves no weight by 0.1 x lr (unclipped:
    # about lr, m / sqrt(v) = sign(g))
    (["--train.grad_clip", "1e-9"], "max(float((p.detach() - before[n]).abs().max()) for n, p in "
     "t.model.named_parameters()) < 0.1 * t.optimizer.param_groups[0]['lr']", True),
    ([], "max(float((p.detach() - before[n]).abs().max()) for n, p in t.model.named_parameters()) > 0.5 * "
     "t.optimizer.param_groups[0]['lr']", True),
]

ARRIVALS_SCRIPT = """
import json, sys
import torch
from hybridpar.config.cli import load_config
from hybridpar.session import start_trainer

rows, base, out = json.loads(sys.argv[1]), sys.argv[2:], []
for args, expr, _ in rows:
    t = start_trainer(load_config([*base, *args]))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train_step(0)
    out.append(eval(expr, {"t": t, "torch": torch, "before": before}))
    t.data.close()
print(json.dumps(out))
"""


@pytest.mark.multiprocess
def test_every_config_field_that_a_component_reads_arrives(cache_dir):
    """The table above, in one interpreter (a Trainer a row): each value is seen where the component keeps it."""
    from conftest import run_cli

    base = ["--data.cache_dir", str(cache_dir), "--train.global_batch_size", "8", "--train.seq_len", "64",
            "--model.n_layers", "1", "--train.eval_interval", "10", "--train.sample_tokens", "0",
            "--logging.wandb.mode", "disabled", "--train.precision", "fp32"]
    out = run_cli(["-c", ARRIVALS_SCRIPT, json.dumps(ARRIVALS), *base])
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for (args, expr, want), value in zip(ARRIVALS, got):
        assert value == pytest.approx(want) if isinstance(want, float) else value == want, (args, expr, value)


def test_a_resume_keeps_the_metrics_rows_up_to_its_checkpoint_and_no_row_without_a_step(tmp_path):
    """The killed run's rows past the checkpoint go, and a torn last line; a row whose step is no integer (a note a
    person added: {"step": "note"} was a TypeError on every resume) is no row of the run's steps and goes too."""
    import json

    from hybridpar.session import _keep_metrics_until

    path = tmp_path / "metrics.jsonl"
    rows = [{"config": 1}, {"step": 1, "loss": 2.0}, {"step": "note"}, {"step": 2.5}, {"step": 4, "loss": 1.0},
            {"step": 5, "loss": 0.5}, ["a", "list"], {"step": True}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    _keep_metrics_until(path, 4)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"config": 1}, {"step": 1, "loss": 2.0},
                                                                           {"step": 4, "loss": 1.0}]
