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
