"""The GPT decoder: one module for GPT-2, GPT-3 and the modern (RoPE/RMSNorm/SwiGLU/GQA) variant.

Plain single-device PyTorch. Build it on the meta device, move it with `to_empty`, then call `init_weights()`;
parallelism (tensor, sequence, data) is applied from outside by hybridpar.parallel, which is why attention reads
the number of heads from the tensor it gets (a tensor-parallel rank holds n_heads/tp of them).

Notation: B batch, T sequence, H d_model, V vocab, nh query heads, nkv key/value heads, hd head dim, F ffn width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from .config import ModelConfig
from .init import keyed_normal_
from .kv_cache import KVCache, LayerCache
from .moe import Experts, MoE


class Where(NamedTuple):
    """What attention needs besides its input: the rotary angles of the tokens' positions ((B or 1, T, hd/2) each;
    None with learned positions) and, when decoding, this layer's KV cache and the call's mask (None: the call's one
    token sees every cached slot). Without a cache attention is causal."""
    rope: tuple[torch.Tensor, torch.Tensor] | None
    kv: LayerCache | None = None
    mask: torch.Tensor | None = None  # (B, 1, T, slots) bool


def _norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.ln_bias)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, hd/2), in fp32 (Su et al. 2021)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, n, hd) by the angles of their positions, cos and sin (B or 1, T,
    hd/2)."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (B, T, n, hd/2)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, T, n, hd/2, 2)
    return out.flatten(-2).type_as(x)


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of h @ weight.T against targets, chunk by chunk over the tokens. The gradients of h and
    weight are made in the same pass (d loss / d logits = softmax - one-hot), so backward only scales them, and no
    [tokens, V] tensor outlives its chunk. Same FLOPs as the plain path: one matmul forward, two backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_tokens: int, ignore_index: int):
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk_tokens):
            hc, yc = h[start:start + chunk_tokens], targets[start:start + chunk_tokens]
            logits = (hc @ weight.t()).float()  # (c, V): the only vocabulary-wide tensor, one chunk at a time
            lse = torch.logsumexp(logits, dim=-1)
            valid = yc != ignore_index
            y = torch.where(valid, yc, 0)
            loss += ((lse - logits.gather(1, y[:, None]).squeeze(1)) * valid).sum()
            g = logits.sub_(lse[:, None]).exp_()  # softmax, in place
            g[torch.arange(len(y), device=y.device), y] -= 1.0  # d loss / d logits = softmax - one-hot
            g = (g * valid[:, None]).to(h.dtype)
            grad_h[start:start + chunk_tokens] = g @ weight
            grad_w += (g.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 4096,
                         ignore_index: int = -100) -> torch.Tensor:
    """sum over tokens of cross_entropy(h @ weight.T, targets) in fp32, ignore_index targets counting zero, without
    materialising the logits: h (..., H), weight (V, H), targets (...). Logits are rounded to h's dtype before the
    fp32 softmax, as the plain path's bf16 logits are."""
    h, targets = h.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, targets, chunk_tokens, ignore_index)
    return sum(F.cross_entropy((h[s:s + chunk_tokens] @ weight.t()).float(), targets[s:s + chunk_tokens],
                               ignore_index=ignore_index, reduction="sum")
               for s in range(0, h.shape[0], chunk_tokens))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        # Separate Q, K, V projections: each is column-parallel on its own, so a tensor-parallel rank gets whole
        # heads of every one of them without re-ordering a fused weight.
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout
        # Attention when this module holds parts of each sequence (set from outside, by context parallelism):
        # (q, k, v, dropout_p) of this call's tokens -> their causal attention over the whole sequence. None: the
        # call holds whole sequences.
        self.context = None

    def forward(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        q = rearrange(self.wq(x), "b t (n d) -> b t n d", d=self.head_dim)  # (B, T, nh, hd)
        k = rearrange(self.wk(x), "b t (n d) -> b t n d", d=self.head_dim)  # (B, T, nkv, hd)
        v = rearrange(self.wv(x), "b t (n d) -> b t n d", d=self.head_dim)  # (B, T, nkv, hd)
        if where.rope is not None:
            q, k = apply_rope(q, *where.rope), apply_rope(k, *where.rope)
        q, k, v = (rearrange(t, "b t n d -> b n t d") for t in (q, k, v))  # (B, n, T, hd)
        dropout = self.dropout if self.training else 0.0
        if where.kv is not None:  # decoding: this call's keys and values join the cached ones
            k, v = where.kv.update(k, v)  # (B, nkv, slots, hd)
        if self.context is not None and where.kv is None:  # parts of each sequence: attention over all of it
            y = self.context(q, k, v, dropout)  # (B, nh, T, hd)
        else:
            y = F.scaled_dot_product_attention(  # causal softmax(QK^T / sqrt(hd)) V, fused where the device has it
                q, k, v, attn_mask=where.mask, is_causal=where.kv is None,  # with a cache: the mask (None: see all)
                dropout_p=dropout, enable_gqa=k.shape[1] != q.shape[1])  # (B, nh, T, hd)
        return self.wo(rearrange(y, "b n t d -> b t (n d)"))  # (B, T, H)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.swiglu, self.gelu_approx = cfg.mlp == "swiglu", cfg.gelu_approx
        if self.swiglu:
            self.gate = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.up = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.down = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))  # SwiGLU (Shazeer 2020)
        return self.down(F.gelu(self.up(x), approximate=self.gelu_approx))  # GPT-2: tanh; Megatron-LM: exact


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = _norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = _norm(cfg)
        self.mlp = (MoE(cfg.d_model, cfg.n_experts, cfg.moe_top_k, cfg.expert_dim, cfg.n_shared_experts,
                        cfg.moe_router) if cfg.n_experts else MLP(cfg))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        x = x + self.attn_branch(x, where)
        return x + self.mlp_branch(x)

    # The two residual branches, each a method so that activation checkpointing can wrap them one at a time.
    def attn_branch(self, x: torch.Tensor, where: Where) -> torch.Tensor:
        return self.drop(self.attn(self.attn_norm(x), where))

    def mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.mlp(self.mlp_norm(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.moe_loss_sum = None  # set from outside where ranks hold parts of a sequence's tokens (GPT.moe_loss)
        if cfg.position == "rope":
            # Not persistent: derived from the config, recomputed by init_weights() after a meta-device build.
            cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head (GPT-2/3). Moving a module off the meta device creates new
        Parameter objects, so this runs again after every such move."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    def init_table(self) -> dict[str, tuple[str, float]]:
        """How each parameter starts, by name: ("normal", std), ("zeros", 0) or ("ones", 0). GPT-2 init: every
        weight ~ N(0, init_std), residual output projections ~ N(0, init_std/sqrt(2L)) so the residual stream's
        variance does not grow with depth (Radford et al. 2019); biases 0, norm gains 1. A tied LM head is the
        token embedding (listed once)."""
        std, resid_std = self.cfg.init_std, self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        table = {}
        for name, mod in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(mod, nn.Linear):
                table[prefix + "weight"] = ("normal", resid_std if name.endswith(("attn.wo", "mlp.down", "shared.down"))
                                            else std)
                if mod.bias is not None:
                    table[prefix + "bias"] = ("zeros", 0.0)
            elif isinstance(mod, Experts):  # the stacked experts: their down projection is a residual output
                table.update({prefix + "w_gate": ("normal", std), prefix + "w_up": ("normal", std),
                              prefix + "w_down": ("normal", resid_std)})
            elif isinstance(mod, nn.Embedding):
                table[prefix + "weight"] = ("normal", std)
            elif isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
                if mod.weight is not None:
                    table[prefix + "weight"] = ("ones", 0.0)
                if getattr(mod, "bias", None) is not None:
                    table[prefix + "bias"] = ("zeros", 0.0)
        if self.cfg.tie_embeddings:
            table.pop("lm_head.weight", None)
        return table

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter by init_table(), the random ones keyed by (seed, name, position) so that a
        sharded model initialised shard by shard gets the same values (models/init.py); then the buffers."""
        self.tie_weights()
        table = self.init_table()
        for name, p in self.named_parameters():
            kind, std = table[name]
            if kind == "normal":
                keyed_normal_(p, std, seed, name)
            else:
                p.fill_(1.0 if kind == "ones" else 0.0)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Non-parameter state computed from the config (RoPE tables), and the experts' selection biases at their
        start (zero; a checkpoint's replace them)."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.expert_bias.zero_()
                layer.mlp.step_counts.zero_()
        if self.cfg.position == "rope":
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def moe_loss(self) -> torch.Tensor | float:
        """The last (training) forward's router losses in the units of a summed token loss: per block,
        moe_aux_loss_coef x T x the per-sequence balance losses' sum (so that over the global batch's tokens it is
        their mean over sequences) plus moe_z_loss_coef x the z-loss summed over tokens; 0 for a dense model. Each
        block's expert counts are added to its step_counts here, once per training forward (a recomputation under
        activation checkpointing does not come here). Where a rank holds part of its sequences' tokens (tensor
        parallelism's token shards), moe_loss_sum adds the other parts' values in (not their gradients), so that
        every such rank reports the same loss."""
        total = 0.0
        for layer in self.layers:
            stats = getattr(layer.mlp, "stats", None)
            if stats is not None:
                layer.mlp.step_counts += stats["counts"]
                total = total + self.cfg.moe_aux_loss_coef * stats["tokens_per_sequence"] * stats["balance_loss"] \
                    + self.cfg.moe_z_loss_coef * stats["z_loss"]
        if self.moe_loss_sum is not None and isinstance(total, torch.Tensor):
            mine = total.detach()
            total = total + (self.moe_loss_sum(mine.clone()) - mine)
        return total

    def moe_blocks(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoE)]

    @torch.no_grad()
    def take_expert_counts(self) -> torch.Tensor | None:
        """(blocks, E) tokens per expert of the training forwards since the last take (this rank's), reset to zero;
        None for a dense model."""
        moe = self.moe_blocks()
        if not moe:
            return None
        counts = torch.stack([m.step_counts.clone() for m in moe])
        for m in moe:
            m.step_counts.zero_()
        return counts

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balance, once per optimizer step: each block's expert_bias moves by `rate`
        towards the experts that got fewer than the mean of the step's tokens (counts (blocks, E): the whole global
        batch's, every rank's summed), away from those that got more."""
        for moe, c in zip(self.moe_blocks(), counts):
            moe.expert_bias += rate * torch.sign(c.mean() - c)

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `length` slots (forward(..., cache=))."""
        return KVCache(len(self.layers), batch, length, self.cfg.max_seq_len, self.tok_embeddings.weight.device)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None,
                loss_chunk_tokens: int = 4096, cache: KVCache | None = None,
                valid: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (B, T) int64 -> logits (B, T, V); with targets (B, T): the summed token cross entropy instead,
        computed by linear_cross_entropy in chunks of loss_chunk_tokens (targets of -100 count zero). With a
        cache: the tokens continue the cached ones (models/kv_cache.py), valid (B, T) bool marking the real ones
        (default all). positions (T,) int64: where the tokens sit in their sequences when they are a part of them
        (context parallelism's chunks; attention's context then supplies the other parts' keys); default 0..T-1."""
        T = input_ids.shape[1]
        given = positions
        if cache is None and T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        if cache is None and positions is None:
            positions = torch.arange(T, device=input_ids.device)  # (T,): the same for every sequence
        elif cache is not None:
            valid = torch.ones_like(input_ids, dtype=torch.bool) if valid is None else valid
            positions = cache.begin(valid)  # (B, T)
        h = self.tok_embeddings(input_ids)  # (B, T, H)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        h = self.drop(h)
        rope = None
        if self.cfg.position == "rope" and cache is None and given is None:
            rope = (self.rope_cos[None, :T], self.rope_sin[None, :T])  # (1, T, hd/2): views of the tables
        elif self.cfg.position == "rope":
            rope = (self.rope_cos[positions], self.rope_sin[positions])  # (B or 1, T, hd/2)
            if rope[0].dim() == 2:
                rope = (rope[0][None], rope[1][None])
        for i, layer in enumerate(self.layers):
            h = layer(h, Where(rope, cache.layers[i], cache.mask) if cache is not None else Where(rope))
        if cache is not None:
            cache.end(valid)
        h = self.norm(h)
        if targets is not None:
            loss = linear_cross_entropy(h, self.lm_head.weight, targets, loss_chunk_tokens)
            return loss + self.moe_loss() if self.training else loss  # (the router losses train, not evaluate)
        return self.lm_head(h)  # (B, T, V)
