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
