"""Learning-rate schedules as pure functions of the step: a resumed run gets the same LR from the step alone."""

from __future__ import annotations

import math

from hybridpar.config import OptimConfig


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """LR of optimizer step `step` (0-based) of `total_steps`.

    Linear warmup from lr/warmup to lr over the first warmup_steps steps, then:
    cosine  min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2, p going 0 -> 1 over the remaining steps
    linear  lr - (lr - min_lr) * p
    constant lr
    wsd     lr until the last decay_steps steps, then linear to min_lr (warmup-stable-decay, Hu et al. 2024)
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        decay = cfg.decay_steps if cfg.decay_steps is not None else max(1, round(0.2 * total_steps))
        start = max(cfg.warmup_steps, total_steps - decay)
        if step < start:
            return cfg.lr
        p = min(1.0, (step - start + 1) / max(1, total_steps - start))
        return cfg.lr - (cfg.lr - cfg.min_lr) * p
    span = max(1, total_steps - cfg.warmup_steps - 1)
    p = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * p
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
