"""parallel.exact_reduction: the parameters after every step, the step's loss and its gradient norm are bitwise the same
(torch.equal) for every data-parallel degree at a fixed tp, with AdamW and with Muon."""

from __future__ import annotations

import os

import pytest

from warm import Results, spawn

ARGS = ["--train.steps", "8", "--train.global_batch_size", "8", "--train.micro_batch_size", "1", "--train.seq_len",
        "32", "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.precision", "fp32",
        "--logging.wandb.mode", "disabled", "--parallel.exact_reduction", "true", "--model.n_layers", "1"]
WORLDS = {1: [(1, 1, 1)], 2: [(1, 2, 1), (1, 1, 2)], 4: [(1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2)]}
STEPS = 8


def _worker(rank: int, world: int, init_file: str, cache_dir: str, layouts, results) -> None:
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import WorldInfo, init_mesh
    from hybridpar.parallel.startup import plain_name
    from hybridpar.resolve import resolve
    from hybridpar.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for optim in ("adamw", "muon"):
            for layout in layouts:
                cfg = load_config([*ARGS, "--optim.name", optim, "--data.cache_dir", cache_dir])
                cfg = replace(cfg, parallel=replace(cfg.parallel, dp_replicate=layout[0], dp_shard=layout[1],
                                                    tp=layout[2]))
                run = resolve(cfg, WorldInfo(rank, world, rank, world), torch.device("cpu"))
                trainer = Trainer(run, init_mesh(run.layout.degrees, run.device))
                steps = []
                for step in range(STEPS):
                    loss, norm, _ = trainer.advance(step)
                    trainer.read_status()
                    weights = {plain_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                               for n, p in trainer.model.named_parameters()}
                    weights["(loss)"], weights["(grad norm)"] = trainer.dp_sum(loss.clone()), norm.clone()
                    steps.append(weights)
                trainer.data.close()
                if rank == 0:
                    results[optim, layout] = steps
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_parameters_are_bitwise_equal_for_every_data_parallel_degree(tmp_path, cache_dir):
    results = Results()
    for world, layouts in WORLDS.items():
        spawn(_worker, args=(world, str(tmp_path / f"init{world}"), str(cache_dir), layouts, results), nprocs=world)
    for optim in ("adamw", "muon"):
        for tp, layouts in ((1, [(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 2, 1)]), (2, [(1, 1, 2), (1, 2, 2), (2, 1, 2)])):
            ref = results[optim, layouts[0]]
            for layout in layouts[1:]:
                got = results[optim, layout]
                for step in range(STEPS):
                    differ = [n for n in ref[step] if not __import__("torch").equal(ref[step][n], got[step][n])]
                    assert differ == [], (optim, layout, step + 1, differ[:3])
            moved = [n for n in ref[0] if not __import__("torch").equal(ref[0][n], ref[-1][n])]
            assert moved, (optim, tp)  # (training changed the parameters)


def _command(n: int, cache_dir, run_dir, *extra) -> tuple[list[str], dict]:
    """n ranks sharding over dp (torchrun, which sets OMP_NUM_THREADS=1 in each), or one process with one intra-op
    thread: a CPU run's thread count sets the order of its matmuls' reductions, which no reduction mode can undo."""
    from conftest import user_env

    args = [*ARGS, "--checkpoint.interval", "3", "--logging.interval", "1", "--parallel.dp_shard", str(n),
            "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir), *extra]
    cmd = ["launch/pretrain_gpt.py", *args] if n == 1 else \
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "launch/pretrain_gpt.py", *args]
    return cmd, {**user_env(), "OMP_NUM_THREADS": "1"}


def _launch(n: int, cache_dir, run_dir, *extra) -> None:
    from conftest import run_cli

    cmd, env = _command(n, cache_dir, run_dir, *extra)
    out = run_cli(cmd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def _start(n: int, cache_dir, run_dir, until, *extra):
    """Start the run on n ranks and wait until `until(run_dir)` holds; returns the torchrun agent."""
    import subprocess
    import sys
    import time

    from conftest import ROOT

    cmd, env = _command(n, cache_dir, run_dir, *extra)
    log = open(run_dir.parent / f"{run_dir.name}-{n}.log", "w")  # its console, for a failure's message
    agent = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.time() + 300
    while not until(run_dir) and agent.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    assert agent.poll() is None, (run_dir.parent / f"{run_dir.name}-{n}.log").read_text()[-3000:]
    return agent


@pytest.mark.multiprocess
def test_killed_on_4_ranks_resumed_on_2_then_preempted_and_requeued_on_1_is_bitwise_the_unbroken_run(tmp_path,
                                                                                                     cache_dir):
    """The unbroken run: 4 data-parallel ranks, 8 steps. The broken one: the same run killed (SIGKILL, agent and
    workers at once) once its step-3 checkpoint is complete; resumed on 2 ranks in the same run dir; that job sent
    SIGTERM (to its workers, as SLURM signals a job step's tasks) once it logged step 4, so it saves, writes
    PREEMPTED and stops; requeued on 1 rank, which finishes. Every step's loss and gradient norm and the step-6
    and step-8 checkpoints' tensors equal the unbroken run's bit for bit. The step-3 checkpoint resumed on 1 rank
    directly gives the same steps too. (With the mode off, step 4 differs: the control run once, 2026-12-04.)"""
    import shutil
    import signal

    import torch

    from conftest import children, kill_job, step_rows
    from hybridpar.checkpoint.dcp import load_full_model_state, read_trainer_state
    from hybridpar.checkpoint.layout import checkpoint_dir, latest_checkpoint, step_of
    from hybridpar.parallel.exact import quantum_of

    extra = ["--train.steps", "8"]
    full = tmp_path / "full"
    _launch(4, cache_dir, full, *extra)
    want = step_rows(full)
    assert sorted(want) == list(range(1, 9))
    # The first step has no grid yet and is replayed once; the grids it and each later step measure hold the next
    # (gradients do not grow 256x in a step here): one replay in 8 steps, not one a step (a grid too fine).
    assert [want[s]["exact_replays"] for s in range(1, 9)] == [1] * 8

    def same(run_dir, steps):
        got = step_rows(run_dir)
        for step in steps:
            assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), \
                (run_dir.name, step)
        # a resume continues on the checkpoint's grids: no replay after step 3 (without them its first step would)
        assert all(got[step]["exact_replays"] == 0 for step in steps if step > 3), (run_dir.name, got)
        for step in (6, 8):
            if (checkpoint_dir(run_dir, step) / "COMPLETE").exists():
                a, b = (load_full_model_state(checkpoint_dir(d, step)) for d in (run_dir, full))
                assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in b), (run_dir.name, step)
                grids = [read_trainer_state(checkpoint_dir(d, step))["exact_bounds"] for d in (run_dir, full)]
                assert torch.equal(*map(torch.as_tensor, grids)), (run_dir.name, step)

    broken = tmp_path / "broken"
    agent = _start(4, cache_dir, broken, lambda d: (checkpoint_dir(d, 3) / "COMPLETE").exists(), *extra)
    kill_job(agent)
    assert latest_checkpoint(broken) == checkpoint_dir(broken, 3)  # (killed before its step-6 save)
    alone = tmp_path / "alone"
    shutil.copytree(checkpoint_dir(broken, 3), checkpoint_dir(alone, 3))
    grid3 = torch.as_tensor(read_trainer_state(checkpoint_dir(alone, 3))["exact_bounds"]).tolist()

    logged = (broken / "metrics.jsonl").read_text().count('"step": 4,')  # (the killed run may have logged step 4)
    agent = _start(2, cache_dir, broken, lambda d: (d / "metrics.jsonl").read_text().count('"step": 4,') > logged,
                   *extra)
    for pid in children(agent.pid):
        os.kill(pid, signal.SIGTERM)
    agent.wait(timeout=300)
    assert (broken / "PREEMPTED").exists(), (tmp_path / "broken-2.log").read_text()[-3000:]
    stopped = step_of(latest_checkpoint(broken))
    assert 4 <= stopped < 8, stopped
    _launch(1, cache_dir, broken, *extra)
    same(broken, range(1, 9))
    assert max(step_rows(broken)) == 8

    _launch(1, cache_dir, alone, *extra)
    same(alone, range(4, 9))
    # The grids moved while the run went on, across the resume: some parameter's quantum (a power of two of its
    # bound) differs between the step-3 checkpoint and the step-8 one, and the resumed runs still match bitwise.
    q3, q8 = ([quantum_of(b) for b in grid] for grid in
              (grid3, torch.as_tensor(read_trainer_state(checkpoint_dir(full, 8))["exact_bounds"]).tolist()))
    assert len(q3) == len(q8) and any(a != b for a, b in zip(q3, q8)), (q3, q8)


def test_the_grid_sums_exactly_replays_a_step_that_outgrew_it_and_passes_a_nan_on():
    """ExactGradients on one process, a plain two-parameter model (no FSDP: the path after each backward). Three
    microbatches whose gradients are set by hand: the written gradient is the float64 sum of the terms rounded once
    to float32 (terms here are multiples of the grid, so the sum is exact), whatever their order; a step whose terms
    pass 256 x the previous bound is replayed on what it measured; a NaN term gives NaN gradients and keeps the
    bounds."""
    import itertools

    import torch
    import torch.distributed as dist
    from torch import nn

    from hybridpar.parallel.distributed import init_mesh
    from hybridpar.parallel.exact import ExactGradients, quantum_of

    model = nn.Linear(3, 2)
    names = {id(model.weight): "w", id(model.bias): "b"}
    gen = torch.Generator().manual_seed(0)
    terms = [(torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen) * 1e3) for _ in range(3)]
    bounds = [max(float(b.abs().max()) for _, b in terms), max(float(w.abs().max()) for w, _ in terms)]  # b, w

    def step(order, bounds, scale=1.0):
        ex.begin(bounds)
        for i in order:
            model.weight.grad, model.bias.grad = terms[i][0] * scale, terms[i][1] * scale
            ex.after_backward()
        return ex.finish()

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ex = ExactGradients(model, init_mesh((1, 1, 1, 1), torch.device("cpu")), names)
        assert step([0, 1, 2], None) == (False, bounds)  # no grid yet: measured, to be replayed
        written = set()
        for order in itertools.permutations(range(3)):
            done, after = step(order, bounds)
            assert done and after == bounds
            written.add((tuple(model.weight.grad.flatten().tolist()), tuple(model.bias.grad.tolist())))
            for p, k, name in ((model.weight, 0, "w"), (model.bias, 1, "b")):
                q = quantum_of(bounds["bw".index(name)])
                want = sum((torch.round(t[k].double() / q) * q for t in terms), torch.zeros(p.shape).double())
                assert torch.equal(p.grad, want.float()), name
                assert float((want - sum(t[k].double() for t in terms)).abs().max()) <= 1.5 * q  # 3 roundings
        assert len(written) == 1  # every order, the same bits
        grown, after = step([0, 1, 2], bounds, scale=600.0)  # past the grid (< 512 x the bound): measured anew
        assert not grown and after == [max(float((t[k] * 600.0).abs().max()) for t in terms) for k in (1, 0)]
        assert model.weight.grad is None and model.bias.grad is None
        terms[1] = (terms[1][0].clone().fill_(float("nan")), terms[1][1])
        done, after = step([0, 1, 2], bounds)
        assert done and after == bounds and model.weight.grad.isnan().all() and model.bias.grad.isnan().all()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("argv, world, message", [
    (["--train.precision", "bf16", "--parallel.dp_replicate", "4", "--parallel.dp_shard", "1"], 4,
     "parallel.exact_reduction in bf16 needs parallel.dp_shard > 1 when dp_replicate > 1"),
    (["--parallel.accumulate_unsharded", "true", "--parallel.dp_shard", "2", "--train.micro_batch_size", "4"], 2,
     "parallel.exact_reduction reduces every microbatch on its own: leave parallel.accumulate_unsharded at auto or "
     "false"),
    (["--model.dropout", "0.1"], 2, "parallel.exact_reduction with model.dropout=0.1: a rank draws its masks"),
    (["--train.global_batch_size", "2048", "--train.micro_batch_size", "1"], 1,
     "parallel.exact_reduction sums at most 1024 microbatches a step; train.global_batch_size=2048 / "
     "train.micro_batch_size=1 makes 2048: raise train.micro_batch_size"),
])
def test_the_mode_refuses_what_it_cannot_sum_exactly(argv, world, message):
    import torch

    from hybridpar.config.cli import load_config
    from hybridpar.errors import ConfigError
    from hybridpar.parallel.distributed import WorldInfo
    from hybridpar.resolve import resolve

    cfg = load_config([*argv, "--parallel.exact_reduction", "true"])
    with pytest.raises(ConfigError) as e:
        resolve(cfg, WorldInfo(0, world, 0, world), torch.device("cpu"))
    assert str(e.value).startswith(message), str(e.value)
    resolve(load_config(argv), WorldInfo(0, world, 0, world), torch.device("cpu"))  # (the same without the mode)


def test_a_resume_at_another_tp_or_micro_batch_says_the_curve_is_no_longer_bitwise(tmp_path):
    """The checkpoint's config (written as a save writes it) at tp 1, micro-batch 2: a resume at tp 2 or at
    micro-batch 1 gets a note naming the change; the same values, or a run without the mode, get none."""
    from dataclasses import replace

    from hybridpar.config.cli import dump_yaml, load_config
    from hybridpar.session import exact_resume_notes

    saved = load_config(["--parallel.exact_reduction", "true", "--train.micro_batch_size", "2"])
    (tmp_path / "config.yaml").write_text(dump_yaml(saved))
    assert exact_resume_notes(tmp_path, saved) == []
    tp2 = replace(saved, parallel=replace(saved.parallel, tp=2))
    [note] = exact_resume_notes(tmp_path, tp2)
    assert "parallel.tp 1 -> 2" in note and "not bitwise" in note, note
    [note] = exact_resume_notes(tmp_path, replace(saved, train=replace(saved.train, micro_batch_size=1)))
    assert "train.micro_batch_size 2 -> 1" in note and "parallel.tp" not in note, note
    assert exact_resume_notes(tmp_path, replace(tp2, parallel=replace(tp2.parallel, exact_reduction=False))) == []


def test_a_torch_without_the_modes_fsdp_hooks_still_trains_without_the_mode(monkeypatch):
    """The mode's module imports torch-private FSDP classes; on a torch without them (the import raises, as
    sys.modules[name] = None makes it) the trainer and session still import, the mode's module is not loaded, and
    asking for the mode on a torch without FSDP's custom reduce-scatter is one ConfigError naming the fix."""
    import importlib
    import sys

    import torch
    from torch.distributed.fsdp import FSDPModule

    import hybridpar
    from hybridpar.config.cli import load_config
    from hybridpar.errors import ConfigError
    from hybridpar.parallel.distributed import WorldInfo

    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp._fully_shard._fsdp_api", None)
    for name in ("hybridpar.parallel.exact", "hybridpar.trainer", "hybridpar.session", "hybridpar.resolve"):
        if name in sys.modules:
            monkeypatch.delitem(sys.modules, name)
    for attr in ("trainer", "session", "resolve"):
        if hasattr(hybridpar, attr):
            monkeypatch.setattr(hybridpar, attr, getattr(hybridpar, attr))
    importlib.import_module("hybridpar.session")  # (imports the trainer and resolve)
    assert "hybridpar.parallel.exact" not in sys.modules
    resolve = importlib.import_module("hybridpar.resolve").resolve
    resolve(load_config([]), WorldInfo(0, 1, 0, 1), torch.device("cpu"))  # the default run resolves
    assert "hybridpar.parallel.exact" not in sys.modules
    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    with pytest.raises(ConfigError, match="parallel.exact_reduction needs FSDP2's custom reduce-scatter"):
        resolve(load_config(["--parallel.exact_reduction", "true"]), WorldInfo(0, 1, 0, 1), torch.device("cpu"))
