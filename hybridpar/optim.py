"""AdamW with decay on matrices only, and global-norm gradient clipping that works for plain and DTensor grads."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW whose weight decay applies to parameters of 2+ dims (linear weights, embeddings) and not to biases or
    norm gains, as in GPT-3 and nanoGPT. Fused kernel on CUDA unless optim.fused says otherwise."""
    decay, no_decay = [], []
    for p in model.parameters():  # each shared (tied) parameter once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm of max_norm (0 = only measure); returns the norm before clipping, as a
    plain tensor on the device (no host sync). Sharded (DTensor) gradients reduce their norm across the mesh."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if hasattr(norm, "full_tensor"):  # DTensor grads: a partial norm; reduce it across the mesh before clipping
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm,
                                             foreach=True)
    return norm
