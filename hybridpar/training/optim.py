"""AdamW with decay on matrices only (or Muon beside it), and global-norm gradient clipping that works for plain
and DTensor grads."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from hybridpar.config import OptimConfig
from hybridpar.errors import ConfigError
from hybridpar.parallel.distributed import local_tensor


def tensor_kind(t: torch.Tensor) -> tuple:
    """What a fused or foreach kernel needs alike across one call: plain tensors, or DTensors of one mesh and
    placements (those kernels refuse a mix of plain tensors and DTensors)."""
    return (t.device_mesh, tuple(t.placements)) if hasattr(t, "device_mesh") else ("plain",)


def build_optimizer(model: nn.Module, cfg: OptimConfig, ns_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """AdamW (optim.name=adamw), or Muon for the blocks' hidden matrices beside AdamW for the rest (muon; see
    hybridpar.training.muon). AdamW's weight decay applies to parameters of 2+ dims (linear weights, embeddings),
    not to biases or norm gains, as in GPT-3 and nanoGPT. Fused kernel for CUDA parameters unless optim.fused says
    otherwise. ns_dtype: Muon's Newton-Schulz precision (bf16 for bf16 runs).

    AdamW has one param group per parameter role (its name with the layer index left out: `layers.*.attn.wq.weight`):
    a role has one tensor kind on every layout (a plain tensor, or DTensors of one mesh and placements), which the
    fused and foreach kernels need (they refuse a mix, and under tensor parallelism without FSDP some parameters stay
    plain tensors beside DTensors), and the groups are the same, in the same order, whatever the layout, so a
    checkpoint's optimizer state loads into any other layout. Every group has the same hyperparameters but the
    decay: the update is AdamW's with two groups. Muon's matrices are one group, in the model's order."""
    from hybridpar.parallel.startup import plain_name
    groups: dict[tuple, dict] = {}
    matrices = []
    for name, p in model.named_parameters():  # each shared (tied) parameter once
        if not p.requires_grad:
            continue
        if takes_muon(name, cfg):
            matrices.append(p)
            continue
        decay = cfg.weight_decay if p.dim() >= 2 else 0.0
        role = re.sub(r"^layers\.\d+\.", "layers.*.", plain_name(name))
        group = groups.setdefault((role, tensor_kind(p)), {"params": [], "weight_decay": decay})
        group["params"].append(p)
    if cfg.name == "muon" and not matrices:
        raise ConfigError("optim.name=muon: this model has no hidden matrices (wq, wk, wv, wo, gate, up, down of "
                          "its blocks) for Muon; use optim.name=adamw")
    return make_optimizer(list(groups.values()), matrices, cfg, ns_dtype)


def takes_muon(name: str, cfg: OptimConfig) -> bool:
    """Whether the parameter of this (possibly wrapped) name is one of Muon's matrices under `cfg`."""
    from hybridpar.parallel.startup import plain_name
    from hybridpar.training.muon import HIDDEN_MATRIX

    return cfg.name == "muon" and HIDDEN_MATRIX.fullmatch(plain_name(name)) is not None


def make_optimizer(groups: list[dict], matrices: list[torch.Tensor], cfg: OptimConfig,
                   ns_dtype: torch.dtype = torch.float32) -> torch.optim.Optimizer:
    """AdamW over `groups`, and with optim.name=muon, Muon over `matrices` beside it."""
    from hybridpar.training.muon import Muon

    params = [p for g in groups for p in g["params"]]
    if cfg.state_dtype == "auto":
        raise ValueError("optim.state_dtype=auto is settled by hybridpar.resolve before an optimizer is built")
    if cfg.state_dtype == "bf16":
        return LowPrecisionAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 state_dtype=torch.bfloat16)
    # Where the parameters live decides the kernel: with FSDP CPU offload they (and the step) are on the CPU.
    fused = cfg.fused if cfg.fused is not None else all(p.device.type == "cuda" for p in params)
    foreach = None if fused else cfg.foreach
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                              fused=fused, foreach=foreach)
    if cfg.name == "adamw":
        return adamw
    return Muon(matrices, adamw, lr=cfg.muon_lr or cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps, scale=cfg.muon_scale, ns_dtype=ns_dtype,
                distribution=cfg.muon_distribution)


def peak_lr_ratio(group: dict, cfg: OptimConfig) -> float:
    """A param group's peak lr over optim.lr, the schedule's peak (Muon's group: optim.muon_lr / optim.lr)."""
    return (cfg.muon_lr or cfg.lr) / cfg.lr if group.get("muon") else 1.0


def clip_grad_norm(model: nn.Module, max_norm: float, norm_of=None) -> torch.Tensor:
    """Clip gradients to a global L2 norm of max_norm (0 = only measure); returns the norm before clipping, as a
    plain tensor on the device (no host sync). norm_of(model), when given, computes the norm instead
    (parallel.exact_reduction's, which does not depend on the layout).

    Gradients are grouped by kind (plain tensors, and DTensors per mesh and placements); each group's norm is
    reduced across the mesh axes its gradients are sharded on (DTensor's full_tensor of a Partial norm), so every
    parameter counts exactly once: a tied parameter appears once in model.parameters(), a replicated one is not
    summed over its replicas.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        groups.setdefault(tensor_kind(g), []).append(g)
    if norm_of is not None:
        total = norm_of(model)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
        return total
    squares = []
    # DTensor warns when a norm reduces over two mesh axes with two all-reduces. Every rank still gets the same value
    # (the first all-reduce leaves identical partial sums inside each group): noise for these norms, quieted here.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        for grads in groups.values():
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            if hasattr(norm, "full_tensor"):
                norm = norm.full_tensor()
            squares.append(norm.float() ** 2)
    finally:
        log.setLevel(level)
    if not squares:
        return torch.zeros((), device=next(model.parameters()).device)
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def optimizer_step(optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor, finite) -> None:
    """The update, skipped when the gradient norm is not finite, then the gradients freed: the fused kernels (and
    LowPrecisionAdamW) skip it on the device (found_inf, no host read); torch's unfused AdamW can only be skipped
    from the host, by finite()."""
    if isinstance(optimizer, LowPrecisionAdamW) or all(g.get("fused") for g in optimizer.param_groups
                                                       if not g.get("muon")):
        optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
        optimizer.step()
    elif finite():
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW with its moments stored in `state_dtype` (optim.state_dtype=bf16: 4 bytes a parameter, not 8), rounded
    to nearest when stored; the update is computed in fp32 from them and applied to the fp32 weights, with torch's
    AdamW arithmetic (decoupled decay, bias-corrected moments). Every operation is elementwise on the local shards,
    so each element steps alike on every layout. found_inf (a 0-dim tensor set before step(), as for the fused
    AdamW): when nonzero the step changes nothing, decided on the device (no host read)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 state_dtype: torch.dtype):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtype, self.found_inf = state_dtype, None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to its parameter's dtype; the moments cast back (exact for
        moments saved in bf16; a checkpoint's fp32 moments are rounded to nearest)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        keep = None if self.found_inf is None else self.found_inf == 0
        for group in self.param_groups:
            (beta1, beta2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # (the moments shard like the parameter: DCP saves and reshards them alike)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                w, g = local_tensor(p), local_tensor(p.grad).float()
                m_kept, v_kept = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                step = state["step"] + 1
                m = m_kept.to(torch.float32, copy=True).lerp_(g, 1 - beta1)  # (copies: a skipped step keeps them)
                v = v_kept.to(torch.float32, copy=True).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
                new = (w * (1 - lr * decay)).sub_(m / denom * (lr / (1 - beta1 ** step)))
                if keep is not None:  # a skipped step keeps every value as it was
                    new, m, v, step = (torch.where(keep, a, b) for a, b in
                                       ((new, w), (m, m_kept), (v, v_kept), (step, state["step"])))
                w.copy_(new)
                m_kept.copy_(m)
                v_kept.copy_(v)
                state["step"] = step

