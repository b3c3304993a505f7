"""Mixture-of-experts feed-forward for the modern family (work in progress, issue 63).

A router scores each token against E experts; the token goes to its top-k, weighted by their renormalised scores
(softmax, as Mixtral; or sigmoid, as DeepSeek-V3), each expert a SwiGLU MLP of width expert_ffn. The experts' weights
are stacked ((E, F, H) and (E, H, F)), so one tensor per projection holds every expert (expert parallelism later
shards its first dim). Dropless: every token is computed by all k experts it chose, whatever their load.

Layout independence, which the balance statistics must not break:
- the auxiliary balance loss is per sequence (f_e: the share of the sequence's token slots routed to e, P_e: the mean
  router probability of e over the sequence's tokens), summed over sequences: a sum of per-sequence terms does not
  depend on how the global batch is split across ranks or microbatches;
- the router z-loss is a sum over tokens;
- the aux-loss-free bias (DeepSeek-V3) changes the selection only, and is updated once per optimizer step from the
  step's expert counts summed over every microbatch and rank (the trainer's: `counts` here is one forward's).

The combine is deterministic: each token's k expert outputs are put back in slot order (a gather by the inverse of
the dispatch permutation) and summed over k in a fixed order; no scatter-add.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm_available(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs here (torch._grouped_mm: CUDA with compute capability >= 9.0 in the torch
    versions that have it); otherwise the per-expert loop is used."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


class MoE(nn.Module):
    def __init__(self, d_model: int, n_experts: int, top_k: int, expert_ffn: int, n_shared: int = 0,
                 router: Literal["softmax", "sigmoid"] = "softmax"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"model.moe_top_k={top_k} must lie between 1 and model.n_experts={n_experts}")
        self.n_experts, self.top_k, self.router_kind = n_experts, top_k, router
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.w_gate = nn.Parameter(torch.empty(n_experts, expert_ffn, d_model))
        self.w_up = nn.Parameter(torch.empty(n_experts, expert_ffn, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, expert_ffn))
        self.shared = None
        if n_shared:
            self.shared = nn.ModuleDict({"gate": nn.Linear(d_model, n_shared * expert_ffn, bias=False),
                                         "up": nn.Linear(d_model, n_shared * expert_ffn, bias=False),
                                         "down": nn.Linear(n_shared * expert_ffn, d_model, bias=False)})
        # DeepSeek-V3's aux-loss-free balance: added to the scores for the selection only (not a parameter)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, H) -> (expert ids (N, k), weights (N, k), the router's probabilities (N, E) fp32, its logits)."""
        logits = self.router(x).float()
        probs = logits.softmax(-1) if self.router_kind == "softmax" else logits.sigmoid()
        chosen = (probs + self.expert_bias).topk(self.top_k, dim=-1).indices  # (N, k): the bias picks, never weighs
        weights = probs.gather(-1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True), probs, logits

    def experts(self, x: torch.Tensor, counts: list[int], grouped: bool = False) -> torch.Tensor:
        """Rows of x (sorted by expert, counts[e] rows for expert e) through their experts' SwiGLU."""
        if grouped:  # one GEMM per projection over every expert (torch._grouped_mm: offsets are cumulative counts)
            offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            g = torch._grouped_mm(x, self.w_gate.transpose(1, 2), offs=offs)
            u = torch._grouped_mm(x, self.w_up.transpose(1, 2), offs=offs)
            return torch._grouped_mm(F.silu(g) * u, self.w_down.transpose(1, 2), offs=offs)
        out = []
        for e, part in enumerate(x.split(counts)):  # the reference: one expert at a time
            out.append(F.linear(F.silu(F.linear(part, self.w_gate[e])) * F.linear(part, self.w_up[e]), self.w_down[e]))
        return torch.cat(out)

    def forward(self, x: torch.Tensor, grouped: bool = False) -> tuple[torch.Tensor, dict]:
        """x (B, T, H) -> (the output (B, T, H), stats): stats holds this forward's per-expert token counts (E,),
        the per-sequence balance loss summed over sequences, and the router z-loss summed over tokens (both
        unscaled)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        chosen, weights, probs, logits = self.route(flat)
        slots = chosen.reshape(-1)  # (N k): token n's j-th choice at n k + j
        order = slots.argsort(stable=True)  # the dispatch permutation: slots grouped by expert, in token order
        counts_t = torch.bincount(slots, minlength=self.n_experts)
        counts = counts_t.tolist()  # (the one host sync of a dropless dispatch)
        y = self.experts(flat.repeat_interleave(self.top_k, dim=0)[order], counts, grouped)
        y = y[order.argsort()].reshape(-1, self.top_k, H)  # back in slot order
        out = (y * weights.unsqueeze(-1).to(y.dtype)).sum(1)
        if self.shared is not None:
            s = self.shared
            out = out + s["down"](F.silu(s["gate"](flat)) * s["up"](flat))
        # per sequence: f_e = E / (k T) x (slots of the sequence routed to e), P_e = mean probability; sum_e f_e P_e
        per_seq = F.one_hot(chosen, self.n_experts).reshape(B, T * self.top_k, self.n_experts).sum(1).float()
        f = per_seq * self.n_experts / (self.top_k * T)
        p = probs.reshape(B, T, self.n_experts).mean(1)
        stats = {"counts": counts_t.detach(), "balance_loss": (f * p).sum(), "tokens_per_sequence": T,
                 "z_loss": logits.logsumexp(-1).square().sum()}
        return out.reshape(B, T, H), stats
