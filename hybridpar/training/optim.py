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


def build_optimizer(model: nn.Module, cfg: OptimConfig, ns_dtype: torch.dtype = torch.float32,
                    seed: int = 0) -> torch.optim.Optimizer:
    """AdamW (optim.name=adamw), or Muon for the blocks' hidden matrices beside AdamW for the rest (muon; see
    hybridpar.training.muon). AdamW's weight decay applies to parameters of 2+ dims (linear weights, embeddings),
    not to biases or norm gains, as in GPT-3 and nanoGPT. Fused kernel for CUDA parameters unless optim.fused says
    otherwise. ns_dtype: Muon's Newton-Schulz precision (bf16 for bf16 runs). seed: of bf16 master weights'
    stochastic rounding (train.seed).

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
    return make_optimizer(list(groups.values()), matrices, cfg, ns_dtype, seed)


def takes_muon(name: str, cfg: OptimConfig) -> bool:
    """Whether the parameter of this (possibly wrapped) name is one of Muon's matrices under `cfg`."""
    from hybridpar.parallel.startup import plain_name
    from hybridpar.training.muon import HIDDEN_MATRIX

    return cfg.name == "muon" and HIDDEN_MATRIX.fullmatch(plain_name(name)) is not None


def make_optimizer(groups: list[dict], matrices: list[torch.Tensor], cfg: OptimConfig,
                   ns_dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.optim.Optimizer:
    """AdamW over `groups`, and with optim.name=muon, Muon over `matrices` beside it."""
    from hybridpar.training.muon import Muon

    params = [p for g in groups for p in g["params"]]
    if cfg.state_dtype == "auto":
        raise ValueError("optim.state_dtype=auto is settled by hybridpar.resolve before an optimizer is built")
    if cfg.state_dtype == "bf16" or cfg.master_dtype == "bf16":
        return LowPrecisionAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 state_dtype=torch.bfloat16 if cfg.state_dtype == "bf16" else torch.float32,
                                 rounding=cfg.master_rounding, seed=seed)
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
        for grads in groups.values():  # (each norm in fp32, whatever the gradients' dtype)
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)), 2.0)
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


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply rounds) of int64 values in [0, 2^32): no product leaves int64."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def element_positions(p: torch.Tensor) -> torch.Tensor:
    """Each local element's position (row-major flat index) in the whole tensor p: a DTensor's shard offset by
    where it starts, a plain tensor's own indices. int64, the local shape."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = local_tensor(p)
    offset = (0,) * p.dim()
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        assert tuple(shape) == tuple(local.shape), (shape, local.shape)
    index = torch.zeros((), dtype=torch.int64, device=local.device)
    stride = 1
    for n, start, size in reversed(list(zip(local.shape, offset, p.shape))):
        index = (torch.arange(n, dtype=torch.int64, device=local.device) + start).mul_(stride).view(
            n, *[1] * index.dim()) + index
        stride *= size
    return index


def rounding_bits(positions: torch.Tensor, seed: int, step: torch.Tensor, tensor_number: int,
                  wide: bool = False) -> torch.Tensor:
    """16 random bits per element (int32), a hash of (seed, step, tensor_number, position): the same for an element
    wherever it is held, and new every step. wide: the tensor has 2^32 elements or more."""
    key = _mix32((step.to(torch.int64) * 0x2545F491 + (seed * 0x9E3779B1 + tensor_number * 0x85EBCA77)) & _M32)
    bits = _mix32((positions & _M32) ^ key)
    if wide:
        bits = _mix32(bits ^ (positions >> 32))
    return (bits & 0xFFFF).to(torch.int32)


def stochastic_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to bf16 up or down in magnitude with probabilities in proportion to its distance from each:
    the 16 random bits added below bf16's last mantissa bit, then those 16 bits dropped (a carry rounds up)."""
    return ((x.view(torch.int32) + bits) & -65536).view(torch.float32).to(torch.bfloat16)


class LowPrecisionAdamW(torch.optim.Optimizer):
    """AdamW with its moments stored in `state_dtype` (optim.state_dtype=bf16: 4 bytes a parameter, not 8), rounded
    to nearest when stored; the update is computed in fp32 from them with torch's AdamW arithmetic (decoupled decay,
    bias-corrected moments) and applied to the weights: fp32 ones as they are; bf16 ones (optim.master_dtype=bf16)
    rounded stochastically (rounding_bits: keyed by `seed`, the step, the tensor's number and each element's
    position in the whole tensor) or with Kahan compensation (a bf16 buffer holds what rounding to nearest dropped;
    the weight is the pair's sum). Every operation is elementwise on the local shards, so each element steps alike on
    every layout. found_inf (a 0-dim tensor set before step(), as for the fused AdamW): when nonzero the step
    changes nothing, decided on the device (no host read)."""

    # per-parameter state that may be missing from a checkpoint (saved without Kahan rounding): it starts at zero
    optional_state = ("compensation",)

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], eps: float,
                 state_dtype: torch.dtype, rounding: str = "stochastic", seed: int = 0):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0))
        self.state_dtype, self.found_inf, self.rounding, self.seed = state_dtype, None, rounding, seed

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to its parameter's dtype; the moments cast back (exact for
        moments saved in their dtype; a checkpoint's fp32 moments are rounded to nearest)."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        keep = None if self.found_inf is None else self.found_inf == 0
        number = -1
        for group in self.param_groups:
            (beta1, beta2), lr, eps, decay = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                number += 1  # (the same for a tensor on every layout: the groups and their order are)
                if p.grad is None:
                    continue
                state = self.state[p]
                low = p.dtype == torch.bfloat16
                if not state:  # (the moments shard like the parameter: DCP saves and reshards them alike)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local_tensor(p).device)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                if low and self.rounding == "kahan" and "compensation" not in state:  # (or resumed without one)
                    state["compensation"] = torch.zeros_like(p)
                w, g = local_tensor(p), local_tensor(p.grad).float()
                m_kept, v_kept = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                c_kept = local_tensor(state["compensation"]) if "compensation" in state else None
                step = state["step"] + 1
                m = m_kept.to(torch.float32, copy=True).lerp_(g, 1 - beta1)  # (copies: a skipped step keeps them)
                v = v_kept.to(torch.float32, copy=True).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
                weight = w.float() if c_kept is None else w.float() + c_kept.float()
                new = (weight * (1 - lr * decay)).sub_(m / denom * (lr / (1 - beta1 ** step)))
                c = None
                if low and c_kept is not None:  # Kahan: round to nearest, keep what rounding dropped
                    rounded = new.to(torch.bfloat16)
                    new, c = rounded, (new - rounded.float()).to(torch.bfloat16)
                elif low:
                    new = stochastic_bf16(new, rounding_bits(element_positions(p), self.seed, step, number,
                                                                   p.numel() >= 2 ** 32))
                if keep is not None:  # a skipped step keeps every value as it was
                    new, m, v, step = (torch.where(keep, a, b) for a, b in
                                       ((new, w), (m, m_kept), (v, v_kept), (step, state["step"])))
                    c = None if c is None else torch.where(keep, c, c_kept)
                w.copy_(new)
                m_kept.copy_(m)
                v_kept.copy_(v)
                if c is not None:
                    c_kept.copy_(c)
                state["step"] = step
