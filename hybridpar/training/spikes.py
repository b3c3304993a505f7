"""Loss spikes: the test against a running window, and data.skip_batches checked against a run's position (steps,
batches and windows: hybridpar.data.positions; what a rewind does: hybridpar.checkpoint.recovery)."""

from __future__ import annotations

import math

from hybridpar.config import SpikeConfig
from hybridpar.data.positions import batch_number
from hybridpar.errors import ConfigError


def check_skips(cfg, step: int, saved, windows, n_batches: int) -> ConfigError | None:
    """What is wrong with data.skip_batches at a run's position (step, the windows its checkpoint saved, all of its
    windows now, the train split's batch count): a batch the position has trained already (a checkpoint at step k
    has trained batch_number(k, its windows)), or more batches than the split holds; None when nothing is."""
    done = batch_number(step, saved) if step else 0
    for a, b in cfg.data.skip_windows:
        if a <= done and not any(x <= a and b <= y for x, y in saved):
            return ConfigError(f"data.skip_batches: batch {a} was trained already (the run is at step {step}, batch "
                               f"{done}); skip batches after {done}")
    need = batch_number(cfg.train.steps, windows)
    if need > n_batches:
        return ConfigError(f"data.skip_batches: train.steps={cfg.train.steps} past the skipped batches would end at "
                           f"batch {need}, but the train split holds {n_batches}: skip fewer batches or lower "
                           f"train.steps")
    return None


def refuse_skips(cfg, step: int, saved, windows, n_batches: int) -> None:
    """check_skips, raised: every rank checks the same numbers (said once)."""
    error = check_skips(cfg, step, saved, windows, n_batches)
    if error is not None:
        error.on_every_rank = True
        raise error


def spike_reason(what: str, value: float, history: list[float], zscore: float, min_rise: float) -> str | None:
    """Why `value` is a spike against `history` (a full window of earlier values): more than zscore standard
    deviations above the window's mean and at least min_rise (a fraction) above it; None when it is not one."""
    mean = sum(history) / len(history)
    std = math.sqrt(sum((v - mean) ** 2 for v in history) / (len(history) - 1))
    if not (value > mean + zscore * std and value > mean * (1 + min_rise)):
        return None
    sigmas = (value - mean) / std if std > 0 else math.inf
    return (f"{what} {value:.4g} is {sigmas:.1f} standard deviations above the mean {mean:.4g} of the last "
            f"{len(history)} steps (+{100 * (value / mean - 1):.0f}%)")


def find_spike(cfg: SpikeConfig, history: list[tuple[float, float]], loss: float, grad_norm: float) -> str | None:
    """The spike test of one step (its global loss and gradient norm) against the window before it (the steps that
    were not spikes, (loss, norm) pairs, oldest first); only a full window tests."""
    if len(history) < cfg.window:
        return None
    reason = spike_reason("loss", loss, [h[0] for h in history], cfg.zscore, cfg.min_rise)
    if reason is None and cfg.grad_norm_zscore > 0:
        reason = spike_reason("gradient norm", grad_norm, [h[1] for h in history], cfg.grad_norm_zscore,
                              cfg.grad_norm_min_rise)
    return reason
