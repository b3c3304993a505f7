"""parallel.exact_reduction: the parameters after every step, the step's loss and its gradient norm are bitwise the same
(torch.equal) for every data-parallel degree at a fixed tp, with AdamW and with Muon."""

from __future__ import annotations

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
                    weights["(loss)"], weights["(grad norm)"] = trainer._dp_sum(loss.clone()), norm.clone()
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


def _launch(n: int, cache_dir, run_dir, *extra):
    """n ranks (torchrun, which sets OMP_NUM_THREADS=1 in each), or one process with one intra-op thread: a CPU
    run's thread count sets the order of its matmuls' reductions, which no reduction mode can undo."""
    from conftest import run_cli, user_env

    args = [*ARGS, "--train.steps", "6", "--checkpoint.interval", "3", "--logging.interval", "1",
            "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir), *extra]
    cmd = ["launch/pretrain_gpt.py", *args] if n == 1 else \
        ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "launch/pretrain_gpt.py", *args]
    out = run_cli(cmd, env={**user_env(), "OMP_NUM_THREADS": "1"}) if n == 1 else run_cli(cmd)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.multiprocess
def test_a_run_on_4_ranks_resumes_bitwise_on_2_and_on_1(tmp_path, cache_dir):
    """The uninterrupted run on 4 data-parallel ranks; its checkpoint of step 3 (what a kill after it leaves)
    resumed on 2 ranks and on 1: steps 4-6 log the same loss and gradient norm, bit for bit, and the step-6
    checkpoints hold the same tensors."""
    import shutil

    import torch

    from conftest import step_rows
    from hybridpar.checkpoint.dcp import load_full_model_state
    from hybridpar.checkpoint.layout import checkpoint_dir

    full = tmp_path / "full"
    _launch(4, cache_dir, full, "--parallel.dp_shard", "4")
    want = step_rows(full)
    final = load_full_model_state(checkpoint_dir(full, 6))
    for n in (2, 1):
        run_dir = tmp_path / f"on{n}"
        (run_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(checkpoint_dir(full, 3), checkpoint_dir(run_dir, 3))
        _launch(n, cache_dir, run_dir, "--parallel.dp_shard", str(n))
        got = step_rows(run_dir)
        assert sorted(got) == [4, 5, 6]
        for step in (4, 5, 6):
            assert (got[step]["loss"], got[step]["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"]), n
        state = load_full_model_state(checkpoint_dir(run_dir, 6))
        assert sorted(state) == sorted(final) and all(torch.equal(state[k], final[k]) for k in final), n
