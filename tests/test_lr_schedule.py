"""The LR schedule is a pure function of the step, with the documented shape."""

from __future__ import annotations

import math

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


def test_cosine_reaches_min_at_last_step_and_is_half_way_in_the_middle():
    lrs = _curve("cosine")
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    mid = 10 + (99 - 10) / 2
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(int(mid), cfg, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (int(mid) - 10) / 89)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


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
    cfg = OptimConfig()
    assert [lr_at(s, cfg, 50) for s in (3, 30, 3)] == [lr_at(3, cfg, 50), lr_at(30, cfg, 50), lr_at(3, cfg, 50)]
