"""The LR schedule is a pure function of the step, with the documented shape."""

from __future__ import annotations

import pytest

from hybridpar.config import OptimConfig
from hybridpar.training.lr_schedule import lr_at


def _curve(schedule, steps=100, **kw):
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, **kw)
    return [lr_at(s, cfg, steps) for s in range(steps)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_to_peak(schedule):
    lrs = _curve(schedule)
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])


def _torch_schedule(after_warmup, steps=100) -> list[float]:
    """The reference: torch's own schedulers, stepped in order (LinearLR warmup 0.1 -> 1 over steps 0-9, then
    `after_warmup(optimizer)` from step 10)."""
    import torch

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=1.0, total_iters=9)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, after_warmup(opt)], milestones=[10])
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_cosine_and_linear_equal_torchs_schedulers():
    import torch.optim.lr_scheduler as S

    assert _curve("cosine") == pytest.approx(_torch_schedule(lambda o: S.CosineAnnealingLR(o, T_max=89, eta_min=0.1)))
    assert _curve("linear") == pytest.approx(_torch_schedule(lambda o: S.LinearLR(o, 1.0, 0.1, total_iters=89)))
    lrs = _curve("cosine")
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)


def test_linear_and_constant():
    lin = _curve("linear")
    assert lin[-1] == pytest.approx(0.1)
    diffs = [a - b for a, b in zip(lin[10:], lin[11:])]
    assert max(diffs) == pytest.approx(min(diffs))
    assert _curve("constant")[10:] == [1.0] * 90


def test_wsd_is_stable_then_decays_over_decay_steps():
    lrs = _curve("wsd", decay_steps=20)
    assert lrs[10:80] == [1.0] * 70
    assert lrs[80] < 1.0 and lrs[-1] == pytest.approx(0.1)
    default = _curve("wsd")  # decay over 20% of the run
    assert default[79] == 1.0 and default[80] < 1.0


def test_pure_function_of_step():
    """Asked in any order (a resumed run asks from its step on), the schedule gives torch's in-order sequence."""
    import random

    import torch.optim.lr_scheduler as S

    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    order = list(range(100))
    random.Random(0).shuffle(order)
    shuffled = dict((s, lr_at(s, cfg, 100)) for s in order)
    want = _torch_schedule(lambda o: S.CosineAnnealingLR(o, T_max=89, eta_min=0.1))
    assert [shuffled[s] for s in range(100)] == pytest.approx(want)
