"""Architecture config of the GPT decoder family.

One dataclass describes every model of the zoo; the architecture is chosen by its fields (norm, position
encoding, MLP kind, kv heads, tying, biases), never by a preset's name. It holds no parallel degrees: how a model
is split across devices is the trainer's business, not the model's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal, Optional


def doc(default, help: str):
    """A dataclass field with a one-line docstring (shown by `--help`, kept in `metadata["help"]`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def doc_required(help: str):
    """A dataclass field with no default (a launcher's required flag), with its one-line docstring."""
    return field(metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    name: str = doc("tiny", "zoo preset to start from; the other model fields override it")
    n_layers: int = doc(4, "number of transformer blocks")
    d_model: int = doc(256, "hidden size H")
    n_heads: int = doc(4, "attention (query) heads")
    n_kv_heads: Optional[int] = doc(None, "key/value heads for grouped-query attention; None = n_heads")
    ffn_hidden_size: Optional[int] = doc(None, "MLP inner width; None = 4*d_model (gelu) or 8/3*d_model rounded up to 256 (swiglu)")
    vocab_size: int = doc(8192, "embedding rows; training takes the tokenizer's size padded (vocab_from_tokenizer) "
                                "unless this is given; it must cover the tokenizer")
    vocab_from_tokenizer: bool = doc(True, "training sets vocab_size from the tokenizer, its size padded up to a "
                                           "multiple of vocab_multiple (whatever the layout); giving --model.vocab_size turns this off")
    vocab_multiple: int = doc(128, "padding multiple of a vocabulary taken from the tokenizer (Megatron-LM's "
                                   "--make-vocab-size-divisible-by); 1 keeps it exact")
    max_seq_len: int = doc(256, "context length the model is built for (learned positions, RoPE tables)")
    norm: Literal["layernorm", "rmsnorm"] = doc("layernorm", "normalisation layer (pre-norm)")
    norm_eps: float = doc(1e-5, "epsilon of the norm layers")
    position: Literal["learned", "rope"] = doc("learned", "position encoding: learned absolute embeddings or rotary")
    rope_theta: float = doc(10000.0, "RoPE base frequency")
    mlp: Literal["gelu", "swiglu"] = doc("gelu", "MLP kind: GELU (up, down) or SwiGLU (gate, up, down)")
    gelu_approx: Literal["tanh", "none"] = doc("tanh", "GELU of the gelu MLP: 'tanh' (GPT-2) or 'none' (exact erf, "
                                               "Megatron-LM's default)")
    bias: bool = doc(True, "biases in linear layers and norms")
    qkv_bias: Optional[bool] = doc(None, "biases on Q, K, V; None = as bias (Megatron-LM's --add-qkv-bias sets it alone)")
    norm_bias: Optional[bool] = doc(None, "LayerNorm biases; None = as bias")
    tie_embeddings: bool = doc(True, "share the input embedding with the LM head")
    dropout: float = doc(0.0, "dropout on attention probabilities and residual branches")
    init_std: float = doc(0.02, "std of the normal init; residual output projections get std/sqrt(2*n_layers)")
    n_experts: int = doc(0, "routed experts of each block's mixture-of-experts feed-forward (models/moe.py); 0 = a "
                            "dense MLP")
    moe_top_k: int = doc(2, "experts each token is routed to")
    moe_ffn_hidden_size: Optional[int] = doc(None, "each expert's SwiGLU width; None = model.ffn_hidden_size's")
    n_shared_experts: int = doc(0, "shared experts every token also goes through (one SwiGLU of n x the expert width)")
    moe_router: Literal["softmax", "sigmoid"] = doc("softmax", "router scores: softmax top-k renormalised "
                                                               "(Mixtral) or sigmoid top-k renormalised (DeepSeek-V3)")
    moe_aux_loss_coef: float = doc(0.01, "weight of the per-sequence load-balance loss (0: off)")
    moe_z_loss_coef: float = doc(0.001, "weight of the router z-loss, the mean squared log-sum-exp of its logits")
    moe_bias_update_rate: float = doc(0.0, "DeepSeek-V3's aux-loss-free balance: each optimizer step moves every "
                                           "expert's selection bias by this much towards the under-loaded experts "
                                           "(their step's token counts over the whole batch); 0 = off, 1e-3 = V3's")

    def __post_init__(self):
        self.validate()

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attn_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def ln_bias(self) -> bool:
        return self.bias if self.norm_bias is None else self.norm_bias

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_dim(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_dim

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.mlp == "gelu":
            return 4 * self.d_model
        # SwiGLU keeps the parameter count of a 4x GELU MLP: 3 * H * F = 2 * H * 4H -> F = 8H/3 (Shazeer 2020).
        return 256 * math.ceil(8 * self.d_model / 3 / 256)

    def validate(self) -> None:
        """Raise ValueError naming the value and the fix when the architecture is inconsistent."""
        for f in ("n_layers", "d_model", "n_heads", "vocab_size", "max_seq_len", "vocab_multiple"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"model.{f}={v!r} must be a positive integer")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                             f"pick n_heads among the divisors of d_model (e.g. d_model/64 = {self.d_model / 64:g})")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head dim, got d_model/n_heads={self.head_dim}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_hidden_size} must be positive (or None)")
        if not (self.init_std > 0 and math.isfinite(self.init_std)):
            raise ValueError(f"model.init_std={self.init_std} must be a positive number (GPT-2's is 0.02)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"model.norm={self.norm!r}: use 'layernorm' or 'rmsnorm'")
        if self.position not in ("learned", "rope"):
            raise ValueError(f"model.position={self.position!r}: use 'learned' or 'rope'")
        if self.gelu_approx not in ("tanh", "none"):
            raise ValueError(f"model.gelu_approx={self.gelu_approx!r}: use 'tanh' (GPT-2) or 'none' (exact erf)")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"model.mlp={self.mlp!r}: use 'gelu' or 'swiglu'")
        if self.n_experts < 0 or self.n_shared_experts < 0:
            raise ValueError(f"model.n_experts={self.n_experts} and model.n_shared_experts={self.n_shared_experts} "
                             f"must be 0 or more")
        if self.n_experts:
            if self.mlp != "swiglu":
                raise ValueError(f"model.n_experts={self.n_experts}: the experts are SwiGLU MLPs; set model.mlp "
                                 f"swiglu")
            if self.moe_aux_loss_coef < 0 or self.moe_z_loss_coef < 0 or self.moe_bias_update_rate < 0:
                raise ValueError(f"model.moe_aux_loss_coef={self.moe_aux_loss_coef}, moe_z_loss_coef="
                                 f"{self.moe_z_loss_coef} and moe_bias_update_rate={self.moe_bias_update_rate} must "
                                 f"be 0 or more")
            if not 1 <= self.moe_top_k <= self.n_experts:
                raise ValueError(f"model.moe_top_k={self.moe_top_k} must lie between 1 and model.n_experts="
                                 f"{self.n_experts}")


MODEL_FIELDS = tuple(f.name for f in fields(ModelConfig))
