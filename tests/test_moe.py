"""The mixture-of-experts feed-forward (models/moe.py): against a token-by-token computation by hand, the grouped GEMM
against the per-expert loop, a bitwise repeatable combine, and balance statistics that do not depend on how a batch
is split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridpar.models.moe import MoE


def _moe(router="softmax", shared=1, seed=0):
    torch.manual_seed(seed)
    m = MoE(32, 6, 2, 48, n_shared=shared, router=router)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m


def _by_hand(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: its router scores, top-2 renormalised, the two experts' SwiGLU and the shared one."""
    out = []
    for t in x.reshape(-1, x.shape[-1]):
        logits = m.router.weight @ t
        p = logits.softmax(-1) if m.router_kind == "softmax" else logits.sigmoid()
        top = p.topk(2).indices
        w = p[top] / p[top].sum()
        ex = m.experts
        o = sum(w[j] * (ex.w_down[e] @ (F.silu(ex.w_gate[e] @ t) * (ex.w_up[e] @ t))) for j, e in enumerate(top.tolist()))
        if m.shared is not None:
            s = m.shared
            o = o + s.down.weight @ (F.silu(s.gate.weight @ t) * (s.up.weight @ t))
        out.append(o)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("router, shared", [("softmax", 1), ("softmax", 0), ("sigmoid", 0)])
def test_moe_equals_each_token_computed_by_hand(router, shared):
    m = _moe(router, shared)
    x = torch.randn(4, 10, 32)
    m.experts.grouped = False
    y, stats = m(x), m.stats
    torch.testing.assert_close(y, _by_hand(m, x), rtol=1e-5, atol=1e-6)
    assert stats["counts"].sum() == 4 * 10 * 2 and len(stats["counts"]) == 6


def test_grouped_gemm_equals_the_per_expert_loop_and_the_combine_repeats_bitwise():
    """CI's torch (2.13, CPU) runs torch._grouped_mm: the grouped path must be taken there, not skipped."""
    from hybridpar.models.moe import grouped_mm_runs

    assert grouped_mm_runs(torch.device("cpu"), torch.float32), "this torch's CPU build has no grouped GEMM"
    m = _moe()
    x = torch.randn(4, 10, 32, requires_grad=True)
    grads, calls = {}, []
    real = torch._grouped_mm

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)
    for grouped in (False, True):
        m.zero_grad()
        x.grad = None
        m.experts.grouped = grouped
        torch._grouped_mm = counted
        try:
            y = m(x)
        finally:
            torch._grouped_mm = real
        stats = m.stats
        (y.square().sum() + stats["balance_loss"] + 1e-3 * stats["z_loss"]).backward()
        grads[grouped] = (y.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None] + [x.grad.clone()])
        assert torch.equal(m(x), y)  # the same bits on a repeat
    assert len(calls) == 3  # the grouped run's three projections, none in the loop's
    torch.testing.assert_close(grads[False][0], grads[True][0], rtol=1e-5, atol=1e-7)  # (two kernels' sums)
    for a, b in zip(grads[False][1], grads[True][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_balance_statistics_add_up_over_any_split_of_the_batch():
    """The balance loss is per sequence and the z-loss per token: the batch's equals its halves' sums (a split over
    ranks or microbatches changes nothing); the balance loss by hand for one sequence."""
    m = _moe()
    x = torch.randn(4, 10, 32)
    m(x)
    whole = m.stats
    halves = []
    for part in (x[:1], x[1:]):
        m(part)
        halves.append(m.stats)
    for key in ("balance_loss", "z_loss"):
        assert whole[key].item() == pytest.approx(sum(h[key].item() for h in halves), rel=1e-6)
    assert torch.equal(whole["counts"], halves[0]["counts"] + halves[1]["counts"])
    one = x[0]
    with torch.no_grad():
        p = (one @ m.router.weight.T).softmax(-1)  # (T, E)
    share = torch.zeros(6)
    for e in p.topk(2, dim=-1).indices.reshape(-1).tolist():
        share[e] += 1
    want = float((share * 6 / (2 * 10) * p.mean(0)).sum())
    assert halves[0]["balance_loss"].item() == pytest.approx(want, rel=1e-5)


def test_the_bias_changes_the_choice_not_the_weights():
    m = _moe(shared=0)
    x = torch.randn(2, 8, 32)
    m(x)
    before = m.stats
    favoured = int(before["counts"].argmin())
    m.expert_bias[favoured] = 10.0  # every token now picks it first
    chosen, weights, probs, _ = m.route(x.reshape(-1, 32))
    assert (chosen == favoured).any(-1).all()
    torch.testing.assert_close(weights, probs.gather(-1, chosen) / probs.gather(-1, chosen).sum(-1, keepdim=True))


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ValueError, match="model.moe_top_k=7 must lie between 1 and model.n_experts=6"):
        MoE(32, 6, 7, 48)


# -- on the mesh: expert parallelism, tp token shards, HSDP and cp, against one process (warm gloo worlds) ----------

MOE = ["--train.global_batch_size", "8", "--train.micro_batch_size", "2", "--train.seq_len", "32",
       "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--train.eval_interval", "1000",
       "--train.eval_batches", "2", "--train.sample_tokens", "0", "--model.name", "gpt-modern-1b",
       "--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "4", "--model.n_kv_heads", "2",
       "--model.n_experts", "8", "--model.moe_top_k", "2", "--model.moe_ffn_hidden_size", "32",
       "--model.moe_bias_update_rate", "0.01", "--optim.lr", "3e-3", "--optim.warmup_steps", "2"]
SHARED = ["--model.n_shared_experts", "1"]
LAYOUTS = {"ep2-in-dp_shard4": ["--parallel.dp_shard", "4", "--parallel.ep", "2"],
           "ep4": ["--parallel.dp_shard", "4", "--parallel.ep", "4", *SHARED],
           "ep2-tp2": ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.ep", "2", *SHARED],
           "ep2-tp2-sp": ["--parallel.dp_shard", "2", "--parallel.tp", "2", "--parallel.ep", "2",
                          "--parallel.sequence_parallel", "true"],
           "hsdp-ep2": ["--parallel.dp_replicate", "2", "--parallel.dp_shard", "2", "--parallel.ep", "2"],
           "cp2-ep2": ["--parallel.dp_shard", "2", "--parallel.cp", "2", "--parallel.ep", "2", *SHARED]}
MOE_STEPS = 8


def _moe_worker(rank: int, world: int, init_file: str, cache_dir: str, cases, results) -> None:
    import torch.distributed as dist

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import WorldInfo, init_mesh, local_tensor
    from hybridpar.parallel.startup import plain_name
    from hybridpar.resolve import resolve
    from hybridpar.trainer import Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, argv in cases:
            cfg = load_config([*MOE, "--data.cache_dir", cache_dir, *argv])
            run = resolve(cfg, WorldInfo(rank, world, rank, world), torch.device("cpu"))
            trainer = Trainer(run, init_mesh(run.layout.degrees, run.device))
            losses, counts = [], []
            for step in range(MOE_STEPS):
                loss, _, _ = trainer.train_step(step)
                losses.append(float(trainer.dp_sum(loss.detach().clone())))
                counts.append(trainer.expert_counts.tolist())
            val = trainer.evaluator.validation()["val_loss"]
            weights = {plain_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else local_tensor(p)).detach()
                       for n, p in trainer.model.named_parameters()}
            bias = [m.expert_bias.clone() for m in trainer.model.moe_blocks()]
            trainer.data.close()
            if rank == 0:
                results[name] = (losses, val, weights, counts, bias)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_every_expert_parallel_layout_trains_the_single_process_curve(tmp_path, cache_dir):
    """8 fp32 steps of a tiny MoE (modern family, GQA 4/2, 8 experts, top-2, with and without a shared expert, the
    aux loss, z-loss and the bias update on) at ep 2 inside dp_shard 4, ep 4, ep 2 x tp 2 (with and without
    sequence parallelism), HSDP with ep 2 and cp 2 x ep 2: losses and validation loss within 1e-5 of one process,
    every weight within 1e-5 of its norm, the step's per-expert token counts and the selection biases equal."""
    from warm import Results, spawn

    results = Results()
    spawn(_moe_worker, args=(1, str(tmp_path / "init1"), str(cache_dir), [("dense-e", []), ("shared", SHARED)],
                             results), nprocs=1)
    spawn(_moe_worker, args=(4, str(tmp_path / "init4"), str(cache_dir), list(LAYOUTS.items()), results), nprocs=4)
    for name, argv in LAYOUTS.items():
        ref = results["shared" if "--model.n_shared_experts" in argv else "dense-e"]
        got = results[name]
        assert ref[0][-1] < ref[0][0]  # it trains
        for step, (a, b) in enumerate(zip(got[0], ref[0]), 1):
            assert abs(a - b) <= 1e-5 * b, (name, step, a, b)
        assert abs(got[1] - ref[1]) <= 1e-5 * ref[1], name
        assert sorted(got[2]) == sorted(ref[2])
        for n, w in ref[2].items():
            err = float((got[2][n] - w).norm() / w.norm())
            assert err <= 1e-5, (name, n, err)
        assert got[3] == ref[3], name  # tokens per expert, every block, every step
        assert all(torch.equal(a, b) for a, b in zip(got[4], ref[4])), name
        assert any(float(b.abs().sum()) > 0 for b in ref[4])  # (the bias moved)


@pytest.mark.parametrize("argv, message", [
    (["--parallel.ep", "3", "--model.n_experts", "6"], "parallel.ep=3 must divide the dp_shard x cp = 4 x 1 ranks"),
    (["--parallel.ep", "4", "--model.n_experts", "6"], "parallel.ep=4 must divide model.n_experts=6"),
    (["--parallel.ep", "2", "--model.n_experts", "0"], "parallel.ep=2 splits the experts of a mixture of experts, "
                                                       "but model.n_experts=0"),
    (["--model.n_experts", "4", "--train.fp8", "tensorwise", "--train.precision", "bf16"],
     "model.n_experts=4: a mixture of experts does not run with train.fp8 yet"),
    (["--model.n_experts", "4", "--optim.name", "muon"], "model.n_experts=4: a mixture of experts does not run with "
                                                         "optim.name muon yet"),
])
def test_expert_layout_refusals_are_one_line(argv, message):
    from hybridpar.config.cli import load_config
    from hybridpar.errors import ConfigError
    from hybridpar.parallel.distributed import Layout
    from hybridpar.parallel.experts import check_moe

    cfg = load_config(["--model.name", "gpt-modern-1b", "--model.moe_top_k", "2", *argv])
    with pytest.raises(ConfigError, match="^" + message) as err:
        check_moe(cfg, Layout(1, 4, 1, 1), [cfg.train.seq_len])
    assert "\n" not in str(err.value)

