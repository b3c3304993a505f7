"""Muon: one process against torch.optim.Muon (torch's own implementation) and a float64 Newton-Schulz written
here; every layout against one process on real gloo ranks; the planner's Muon figures against the dry run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from hybridpar.config.cli import load_config
from hybridpar.errors import ConfigError
from hybridpar.models import build_model
from hybridpar.training.muon import HIDDEN_MATRIX, newton_schulz
from hybridpar.training.optim import build_optimizer
from warm import Results, spawn

MODERN = ["--model.norm", "rmsnorm", "--model.position", "rope", "--model.mlp", "swiglu", "--model.bias", "false",
          "--model.n_kv_heads", "4", "--model.tie_embeddings", "false"]


def _model(extra=()):
    cfg = load_config(["--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "8", *extra])
    model = build_model(cfg.model, device="cpu")
    return cfg, model


@pytest.mark.parametrize("extra, nesterov, scale", [([], True, "match_rms_adamw"), (MODERN, False, "original")],
                         ids=["gpt", "modern"])
def test_one_process_update_is_torch_muon_beside_torch_adamw(extra, nesterov, scale):
    """Same settings, bf16 Newton-Schulz (torch.optim.Muon's): bitwise the same weights after three steps."""
    cfg, model = _model(extra)
    optim = replace(cfg.optim, name="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.9, muon_nesterov=nesterov,
                    muon_scale=scale, fused=False, foreach=False)
    ours = build_optimizer(model, optim, ns_dtype=torch.bfloat16)
    twin = build_model(cfg.model, device="cpu")
    twin.load_state_dict(model.state_dict())
    hidden = [p for n, p in twin.named_parameters() if HIDDEN_MATRIX.fullmatch(n)]
    assert len(hidden) == 2 * (7 if extra else 6)  # wq wk wv wo (gate) up down per block
    rest = [p for n, p in twin.named_parameters() if not HIDDEN_MATRIX.fullmatch(n)]
    ref = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=scale),
           torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                             lr=0.02, betas=(optim.beta1, optim.beta2), eps=optim.eps, foreach=False)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        for (_, p), q in zip(model.named_parameters(), twin.parameters()):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        ours.step()
        for o in ref:
            o.step()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(p, q), name
    assert sum(1 for s in ours.state.values() if "momentum_buffer" in s) == len(hidden)


def test_found_inf_skips_the_whole_update_on_the_device():
    """The trainer's device-side skip (found_inf, as for the fused AdamW): 1 leaves weights and both optimizers'
    state as they were, 0 gives bitwise the update of a step without it."""
    cfg, model = _model(MODERN)
    optim = replace(cfg.optim, name="muon", fused=True)
    runs = []
    for found in (None, 0.0, 1.0):
        m = build_model(cfg.model, device="cpu")
        m.load_state_dict(model.state_dict())
        opt = build_optimizer(m, optim)
        for step in range(2):
            for p in m.parameters():
                p.grad = torch.full_like(p, 0.01 * (step + 1))
            if step == 1 and found is not None:
                opt.found_inf = torch.tensor(found)
            before = {n: p.clone() for n, p in m.named_parameters()}
            state = [v.clone() for s in opt.state.values() for v in s.values()]
            opt.step()
        runs.append((before, state, {n: p.clone() for n, p in m.named_parameters()},
                     [v.clone() for s in opt.state.values() for v in s.values()]))
    (_, _, plain, plain_state), (_, _, zero, zero_state), (before, state, skipped, skipped_state) = runs
    assert all(torch.equal(plain[n], zero[n]) for n in plain) and all(map(torch.equal, plain_state, zero_state))
    assert all(torch.equal(before[n], skipped[n]) for n in before) and all(map(torch.equal, state, skipped_state))
    assert not all(torch.equal(before[n], plain[n]) for n in before)


def _ns64(u: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration X <- a X + (b A + c A^2) X, A = X X^T, on the wide orientation, in float64."""
    x = u.double()
    x = x.T if x.shape[0] > x.shape[1] else x
    x = x / torch.linalg.matrix_norm(x)
    for _ in range(steps):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x.T if u.shape[0] > u.shape[1] else x


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (32, 32)])
def test_fp32_newton_schulz_is_the_quintic_iteration_and_nearly_orthogonal(shape):
    u = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    got = newton_schulz(u, 5, torch.float32)
    assert got.dtype == torch.float32 and got.shape == u.shape
    assert torch.allclose(got.double(), _ns64(u, 5), rtol=0, atol=1e-5)
    s = torch.linalg.svdvals(got)  # the iteration's fixed band, not exact orthogonality
    assert 0.6 < float(s.min()) and float(s.max()) < 1.25


@pytest.mark.parametrize("args, message", [
    (["--optim.muon_momentum", "1"], "optim.muon_momentum=1.0 must be in [0, 1)"),
    (["--optim.muon_momentum", "-0.1"], "optim.muon_momentum=-0.1 must be in [0, 1)"),
    (["--optim.muon_ns_steps", "0"], "optim.muon_ns_steps=0 must be > 0"),
    (["--optim.name", "sgd"], "optim.name='sgd' is not one of adamw, muon"),
    (["--optim.name", "muon", "--parallel.fsdp_cpu_offload", "true"], "optim.name=muon with "
     "parallel.fsdp_cpu_offload=true: Muon's all-to-alls run where the process group does and offloaded matrices "
     "stay in host memory; turn one off"),
])
def test_bad_muon_settings_are_one_line(args, message):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert str(e.value) == message


def test_muon_on_a_model_without_hidden_matrices_is_one_line():
    cfg = load_config(["--optim.name", "muon"])
    with pytest.raises(ConfigError, match="^optim.name=muon: this model has no hidden matrices .*; use "
                                          "optim.name=adamw$"):
        build_optimizer(nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4)), cfg.optim)


# 20 steps of global batch 8 (one microbatch a rank); each layout of 4 ranks, sequence parallel where tp > 1.
STEPS = 20
COMMON = ["--train.steps", str(STEPS), "--train.global_batch_size", "8", "--train.seq_len", "32",
          "--train.precision", "fp32", "--train.eval_interval", "0", "--train.sample_tokens", "0",
          "--logging.wandb.mode", "disabled", "--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "8",
          "--optim.name", "muon", "--optim.warmup_steps", "2", "--optim.lr", "0.01"]
MODELS = {"gpt": [], "modern": MODERN}
LAYOUTS_4 = ((1, 4, 1), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 1))
CASES = [(m, layout, "owner") for m in MODELS for layout in LAYOUTS_4] + [("modern", (1, 2, 2), "gather")]


def _muon_worker(rank: int, world: int, init_file: str, cache_dir: str, cases, results) -> None:
    import torch.distributed as dist

    from hybridpar.parallel.distributed import WorldInfo, init_mesh
    from hybridpar.parallel.startup import plain_name
    from hybridpar.resolve import resolve
    from hybridpar.trainer import Trainer

    torch.set_num_threads(1)  # 4 ranks on the 2 cores of CI: more threads only contend
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for model, layout, distribution in cases:
            dp = layout[0] * layout[1]
            cfg = load_config([*COMMON, *MODELS[model], "--data.cache_dir", cache_dir,
                               "--train.micro_batch_size", str(8 // dp),
                               "--optim.muon_distribution", distribution])
            cfg = replace(cfg, parallel=replace(cfg.parallel, dp_replicate=layout[0], dp_shard=layout[1], tp=layout[2]))
            run = resolve(cfg, WorldInfo(rank, world, rank, world), torch.device("cpu"))
            trainer = Trainer(run, init_mesh(run.layout.degrees, run.device))
            losses = []
            for step in range(STEPS):
                losses.append(trainer.dp_sum(trainer.train_step(step)[0]))
            trainer.read_status()
            weights = {plain_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                       for n, p in trainer.model.named_parameters()}
            trainer.data.close()
            if rank == 0:
                results[model, layout, distribution] = ([float(x) for x in losses], weights, trainer.state.skipped)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_layout_gives_the_single_process_muon_curve(tmp_path, cache_dir):
    """20 Muon steps of the tiny GPT and the tiny modern model (RoPE, SwiGLU, GQA) on every layout of 4 gloo ranks:
    the loss curve equals one process's to 1e-5 relative (fp32), and so does every weight of the modern model; the
    gather distribution gives the owner distribution's weights bitwise. The GPT family's weights are not compared:
    under TP they drift from one process's by up to 2e-4 of a tensor's norm in 20 steps with AdamW as well
    (2026-12-01: (1, 1, 4), AdamW 1.6e-4, Muon 1.8e-4, with or without Q/K/V biases; the modern model 6e-6).
    """
    results = Results()
    spawn(_muon_worker, args=(1, str(tmp_path / "init1"), str(cache_dir), [(m, (1, 1, 1), "owner") for m in MODELS],
                              results), nprocs=1)
    spawn(_muon_worker, args=(4, str(tmp_path / "init4"), str(cache_dir), CASES, results), nprocs=4)
    for model, layout, distribution in CASES:
        ref_losses, ref_weights, _ = results[model, (1, 1, 1), "owner"]
        losses, weights, skipped = results[model, layout, distribution]
        assert skipped == 0 and ref_losses[-1] < ref_losses[0] - 1.0  # it trains
        for step, (got, want) in enumerate(zip(losses, ref_losses), 1):
            assert abs(got - want) <= 1e-5 * want, (model, layout, step, got, want)
        assert sorted(weights) == sorted(ref_weights)
        if model == "modern":  # see the docstring for the GPT family's weights
            for name, w in ref_weights.items():
                err = float((weights[name] - w).norm() / w.norm())
                assert err <= 1e-5, (model, layout, distribution, name, err)
    gathered, owned = results["modern", (1, 2, 2), "gather"][1], results["modern", (1, 2, 2), "owner"][1]
    assert all(torch.equal(gathered[n], owned[n]) for n in owned)


# (model, nodes, layout, rank, distribution), 8 GPUs a node (tests/test_plan.py checks gpt3-175b at 1,024 ranks):
# gpt-modern-1b's rank 40 of (2, 8, 4) is member 8 of a shard group of 32 (a replica's): it owns 4 of the 112.
PLANS = [("gpt-modern-1b", 8, ["--parallel.tp", "4", "--parallel.dp_replicate", "2"], 40, "owner"),
         ("gpt-modern-1b", 8, ["--parallel.tp", "8"], 63, "gather")]


@pytest.mark.parametrize("model, nodes, layout, rank, distribution", PLANS,
                         ids=[f"{p[0]}-{p[1] * 8}-rank{p[3]}-{p[4]}" for p in PLANS])
def test_planner_muon_figures_equal_the_dry_run(model, nodes, layout, rank, distribution, capsys):
    """Optimizer bytes (one fp32 buffer for Muon's matrices), Newton-Schulz FLOPs and all-to-all bytes of the
    planner against the dry run's real Muon optimizer and parallelised model."""
    import json

    from test_plan import plan_cli

    rc = plan_cli.main(["--model.name", model, "--cluster.nodes", str(nodes), "--cluster.gpus_per_node", "8",
                        "--train.global_batch_size", str(16 * nodes), "--rank", str(rank), "--top", "0", "--dry-run",
                        "--json", "--optim.name", "muon", "--optim.muon_distribution", distribution, *layout])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    r = json.loads(out.out)
    assert r["dry_run_matches"] is True and r["dry_run_optimizer_bytes"] == r["optimizer_bytes_per_gpu"]
    assert (r["dry_run_muon_ns_flops"], r["dry_run_muon_comm_bytes"]) == (r["muon_ns_flops"], r["muon_comm_bytes"])
    assert r["muon_ns_s"] > 0 and r["muon_comm_s"] > 0
    # 16 blocks of wq wk wv wo (2048^2, 512 x 2048 twice, 2048^2), gate up down
    shapes = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (8192, 2048), (8192, 2048), (2048, 8192)]
    flops = [5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes]
    # gather: all 112; owner: matrices 8, 40, 72, 104 = (block 1, wk), (5, up), (10, wv), (14, down)
    assert r["muon_ns_flops"] == (16 * sum(flops) if distribution == "gather" else
                                  flops[1] + flops[5] + flops[2] + flops[6])


@pytest.mark.multiprocess
def test_muon_lr_moves_exactly_the_hidden_matrices_under_ac_and_compile(tmp_path, cache_dir):
    """Through the launcher with activation checkpointing (full) and torch.compile, whose wrappers rename every
    parameter (the shipped 1.3B+ configs turn AC on): one step from the same seed checkpoint with optim.muon_lr 0.02
    and 0.04 (optim.lr 0.001 in both). Muon's update, decay included, is proportional to its lr, so each hidden
    matrix (by hand: wq, wk, wv, wo, up, down of both layers, 12 tensors) moves exactly twice as far; every other
    tensor, AdamW's at optim.lr, moves bitwise the same. Matrices left to AdamW, or Muon at optim.lr, fail this."""
    from conftest import run_cli
    from hybridpar.checkpoint.dcp import load_full_model_state
    from hybridpar.checkpoint.layout import checkpoint_dir

    base = [*COMMON, "--optim.lr", "0.001", "--optim.warmup_steps", "0", "--data.cache_dir", str(cache_dir),
            "--train.activation_checkpointing", "full", "--train.compile", "true", "--checkpoint.interval", "1"]
    seed = tmp_path / "seed"
    out = run_cli(["launch/pretrain_gpt.py", *base, "--train.steps", "0", "--run.dir", str(seed)])
    assert out.returncode == 0, out.stderr[-3000:]
    moved = {}
    for muon_lr in ("0.02", "0.04"):
        d = tmp_path / muon_lr
        out = run_cli(["launch/pretrain_gpt.py", *base, "--train.steps", "1", "--optim.muon_lr", muon_lr,
                       "--checkpoint.load", str(checkpoint_dir(seed, 0)), "--run.dir", str(d)])
        assert out.returncode == 0, out.stderr[-3000:]
        moved[muon_lr] = load_full_model_state(checkpoint_dir(d, 1))
    w0 = load_full_model_state(checkpoint_dir(seed, 0))
    hidden = {f"layers.{i}.{m}.weight" for i in (0, 1) for m in ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.up",
                                                                "mlp.down")}
    assert hidden <= set(w0)
    for name, w in w0.items():
        a, b = moved["0.02"][name] - w, moved["0.04"][name] - w
        if name in hidden:
            assert float((b - 2 * a).norm() / b.norm()) < 1e-4 and float(a.norm()) > 0, name
        else:
            assert torch.equal(a, b) and float(a.norm()) > 0, name


@pytest.mark.multiprocess
def test_muon_bytes_sent_on_ranks_are_the_planners(tmp_path, cache_dir):
    """A real 4-rank Muon run (dp_shard 2 x tp 2, 3 blocks: 18 matrices over a shard group of 4, owned 5, 5, 4, 4):
    the all-to-alls of step 2's optimizer step, read from each rank's profiler trace (the split sizes it sent to the
    other ranks, in fp32), carry the bytes the planner's muon_share gives that rank."""
    import json

    from conftest import run_cli
    from hybridpar.parallel.distributed import Layout
    from hybridpar.planning.cost import plan_of

    run_dir = tmp_path / "run"
    argv = ["--train.steps", "2", "--train.global_batch_size", "8", "--train.seq_len", "32", "--model.n_layers", "3",
            "--train.eval_interval", "0", "--train.sample_tokens", "0", "--train.precision", "fp32",
            "--logging.wandb.mode", "disabled", "--optim.name", "muon", "--parallel.dp_shard", "2", "--parallel.tp",
            "2", "--profile.steps", "2-2", "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)]
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "launch/pretrain_gpt.py",
                   *argv])
    assert out.returncode == 0, out.stderr[-3000:]
    cfg, shares = load_config(argv), set()
    for rank in range(4):
        trace = json.loads((run_dir / "profile" / f"rank{rank}.steps2-2.pt.trace.json").read_text())
        sent = 0
        for e in trace["traceEvents"]:
            if e.get("ph") == "X" and e["name"] == "c10d::alltoall_base_":
                splits = json.loads(e["args"]["Concrete Inputs"][4])  # the input split sizes, one per member
                sent += 4 * (sum(splits) - splits[rank])
        want = plan_of(cfg, Layout(1, 2, 2), rank).muon["muon_comm_bytes"]
        assert sent == want > 0, (rank, sent, want)
        shares.add(want)
    assert len(shares) > 1  # the members' shares differ: a rank's own is measured, not a mean
