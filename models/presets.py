"""The zoo: named presets of ModelConfig.

GPT-2 (Radford et al. 2019) and GPT-3 (Brown et al. 2020, Table 2.1) share one architecture: learned positions,
pre-LN LayerNorm with bias, GELU MLP of width 4*d_model, tied embeddings. Their vocabulary of 50257 BPE tokens is
padded to 50304 (the next multiple of 128) so the embedding and LM-head matmuls hit tensor-core friendly shapes;
the 47 extra rows are never produced by the tokenizer.

GPT-3 head counts: the paper's d_head x n_heads equals d_model for every size but two.
- gpt3-1.3b: the paper lists 24 heads of 128 for d_model 2048 (3072 != 2048). As Megatron-LM's GPT-3 1.3B
  recipe does, hybridpar keeps d_head = 128 and d_model = 2048, hence 16 heads.
- gpt3-13b: the paper lists d_model 5140 with 40 heads of 128 (5120). 5140 = 4 * 5 * 257 has no head count with a
  usable head size, so hybridpar uses d_model 5120 = 40 x 128, as Megatron-LM's GPT-3 13B recipe does. The
  parameter count stays within 1.2% of the paper's 13.0B.

The "modern" family is the same decoder with RoPE, RMSNorm, SwiGLU, grouped-query attention (8 kv heads),
untied embeddings and no biases, in the shapes popularised by Llama-class models, with a 32000-token vocabulary.
"""

from __future__ import annotations

GPT2_VOCAB = 50304  # 50257 padded to a multiple of 128

_GPT = dict(norm="layernorm", position="learned", mlp="gelu", bias=True, tie_embeddings=True)
_MODERN = dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False, tie_embeddings=False,
               vocab_size=32000, max_seq_len=4096, n_kv_heads=8, rope_theta=500000.0, norm_eps=1e-5)


def _gpt2(n_layers, d_model, n_heads):
    return dict(_GPT, n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=GPT2_VOCAB, max_seq_len=1024)


def _gpt3(n_layers, d_model, n_heads):
    return dict(_GPT, n_layers=n_layers, d_model=d_model, n_heads=n_heads, vocab_size=GPT2_VOCAB, max_seq_len=2048)


PRESETS: dict[str, dict] = {
    # A few-layer model for CPU runs and tests: the default run's model. Vocab matches the default tokenizer.
    "tiny": dict(_GPT, n_layers=4, d_model=128, n_heads=4, vocab_size=4096, max_seq_len=256),
    "gpt2-124m": _gpt2(12, 768, 12),
    "gpt2-355m": _gpt2(24, 1024, 16),
    "gpt2-774m": _gpt2(36, 1280, 20),
    "gpt2-1.5b": _gpt2(48, 1600, 25),
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "gpt-modern-1b": dict(_MODERN, n_layers=16, d_model=2048, n_heads=32, ffn_hidden_size=8192),
    "gpt-modern-7b": dict(_MODERN, n_layers=32, d_model=4096, n_heads=32, ffn_hidden_size=14336),
    "gpt-modern-13b": dict(_MODERN, n_layers=40, d_model=5120, n_heads=40, ffn_hidden_size=16384),
}

# Parameter counts the GPT-3 paper reports (Table 2.1), for the zoo's tests and docs.
GPT3_PAPER_PARAMS = {
    "gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9,
    "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13.0e9, "gpt3-175b": 175.0e9,
}
