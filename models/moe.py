"""Mixture-of-experts feed-forward for the modern family.

A router scores each token against E experts; the token goes to its top-k, weighted by their renormalised scores
(softmax, as Mixtral; or sigmoid, as DeepSeek-V3), each expert a SwiGLU MLP of width expert_ffn. The experts' weights
are stacked ((E, F, H) and (E, H, F)) in one Experts module, so one tensor per projection holds every expert (expert
parallelism shards its first dim, hybridpar/parallel/experts.py). Dropless: every token is computed by all k experts
it chose, whatever their load.

Layout independence, which the balance statistics must not break:
- the auxiliary balance loss is per sequence (f_e: the share of the sequence's token slots routed to e, P_e: the mean
  router probability of e over the sequence's tokens), summed over sequences: a sum of per-sequence terms does not
  depend on how the global batch is split across ranks or microbatches. Where a sequence is split over ranks
  (context parallelism, or tensor parallelism's token shards) `sequence_sum` (set from outside) adds up its counts
  over those ranks and `sequence_pieces` says into how many pieces it is cut;
- the router z-loss is a sum over tokens;
- the aux-loss-free bias (DeepSeek-V3) changes the selection only, and is updated once per optimizer step from the
  step's expert counts summed over every microbatch and rank (`step_counts` adds up each training forward's).

The combine is deterministic: each token's k expert outputs are put back in slot order (a gather by the inverse of
the dispatch permutation) and summed over k in a fixed order; no scatter-add.
"""

from __future__ import annotations

from typing import Callable, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM (torch._grouped_mm) exists and runs for this device type and dtype, probed once
    with a tiny call (CUDA builds run it in bf16 from compute capability 9.0; recent CPU builds have a kernel too)."""
    key = (device.type if device.type != "cuda" else f"cuda{torch.cuda.get_device_capability(device)}", dtype)
    if key not in _GROUPED:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a, b = torch.zeros(8, 16, device=device, dtype=dtype), torch.zeros(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(a, b, offs=torch.tensor([4, 8], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED[key] = ok
    return _GROUPED[key]


_GROUPED: dict[tuple, bool] = {}


def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned strides and base pointers."""
    align = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % align == 0 for s in t.stride()[:-1])


class SwiGLU(nn.Module):
    """The shared expert(s): one SwiGLU MLP of n_shared x the expert width."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.gate = nn.Linear(d_model, width, bias=False)
        self.up = nn.Linear(d_model, width, bias=False)
        self.down = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Experts(nn.Module):
    """E SwiGLU experts, stacked: w_gate, w_up (E, F, H), w_down (E, H, F)."""

    def __init__(self, n_experts: int, d_model: int, width: int):
        super().__init__()
        self.w_gate = nn.Parameter(torch.empty(n_experts, width, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, width, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, width))
        self.grouped = True  # torch._grouped_mm where it runs (grouped_mm_runs); False: the per-expert loop

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by expert, counts[e] of them for expert e, through their experts."""
        return self.compute(x, counts.tolist(), self.w_gate, self.w_up, self.w_down)  # (a dropless dispatch's sync)

    def compute(self, x: torch.Tensor, counts: list[int], w_gate, w_up, w_down) -> torch.Tensor:
        if (self.grouped and x.dtype == w_gate.dtype and grouped_mm_runs(x.device, x.dtype)
                and all(map(_aligned, (x, w_gate, w_up, w_down)))):
            # one GEMM per projection over every expert; offsets are the cumulative counts
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            g = torch._grouped_mm(x, w_gate.transpose(1, 2), offs=offs)
            u = torch._grouped_mm(x, w_up.transpose(1, 2), offs=offs)
            return torch._grouped_mm(F.silu(g) * u, w_down.transpose(1, 2), offs=offs)
        out = [x[:0].new_zeros(0, w_down.shape[1])]
        for e, part in enumerate(x.split(counts)):  # the reference: one expert at a time
            if len(part):
                out.append(F.linear(F.silu(F.linear(part, w_gate[e])) * F.linear(part, w_up[e]), w_down[e]))
        return torch.cat(out)


class MoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, expert_ffn: int, n_shared: int = 0,
                 router: Literal["softmax", "sigmoid"] = "softmax"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.moe_top_k={top_k} must lie between 1 and model.n_experts={n_experts}")
        self.n_experts, self.top_k, self.router_kind = n_experts, top_k, router
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, expert_ffn)
        self.shared = SwiGLU(d_model, n_shared * expert_ffn) if n_shared else None
        # DeepSeek-V3's aux-loss-free balance: added to the scores for the selection only (not a parameter)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)
        # tokens per expert over the training forwards since the last take (GPT.take_expert_counts)
        self.register_buffer("step_counts", torch.zeros(n_experts), persistent=False)
        self.sequence_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self.sequence_pieces = 1
        self.stats: Optional[dict] = None  # the last forward's routing statistics

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> (expert ids (N, k), weights (N, k), the router's probabilities (N, E) fp32, its logits)."""
        logits = self.router(x).float()
        probs = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        chosen = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices  # (N, k): the bias picks, never weighs
        weights = probs.gather(-1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True), probs, logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, H) -> the output (B, T, H). self.stats: this forward's per-expert token counts (E,), the
        per-sequence balance loss summed over sequences, the router z-loss summed over tokens (both unscaled) and the
        whole sequence's length."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        chosen, weights, probs, logits = self.route(flat)
        slots = chosen.reshape(-1)  # (N k): token n's j-th choice at n k + j
        order = slots.argsort(stable=True)  # the dispatch permutation: slots grouped by expert, in token order
        counts = torch.bincount(slots, minlength=self.n_experts)
        y = self.experts(flat.repeat_interleave(self.top_k, dim=0)[order], counts)
        y = y[order.argsort()].reshape(-1, self.top_k, H)  # back in slot order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        if self.shared is not None:
            out = out + self.shared(flat)
        # per sequence: f_e = E / (k T) x (slots of the sequence routed to e), P_e = mean probability; sum_e f_e P_e
        per_seq = F.one_hot(chosen, self.n_experts).reshape(B, T * self.top_k, self.n_experts).sum(1).float()
        if self.sequence_sum is not None:
            per_seq = self.sequence_sum(per_seq)  # the whole sequence's counts, where it is cut into pieces
        length = T * self.sequence_pieces
        f = per_seq * self.n_experts / (self.top_k * length)
        p = probs.reshape(B, T, self.n_experts).sum(1) / length  # (this piece's part of the mean)
        self.stats = {"counts": counts.detach(), "balance_loss": (f * p).sum(), "tokens_per_sequence": length,
                      "z_loss": logits.logsumexp(-1).square().sum()}
        return out.reshape(B, T, H)
