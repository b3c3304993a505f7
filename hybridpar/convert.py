"""Checkpoint conversion: hybridpar DCP <-> Hugging Face transformers folders, and DCP -> one safetensors file.

Families:
- GPT-2/GPT-3 (layernorm, learned positions, GELU, biases, tied embeddings) <-> `GPT2LMHeadModel`. GPT-2's linear
  layers are Conv1D modules storing weight as (in, out), the transpose of nn.Linear; Q, K and V are one c_attn.
- modern (rmsnorm, RoPE, SwiGLU, GQA, no biases) <-> `LlamaForCausalLM`. hybridpar rotates interleaved pairs
  (x[2i], x[2i+1]) of each head; Llama rotates the two halves (x[i], x[i + hd/2]); the Q and K rows of every head
  are permuted between the two orders so the attention scores are identical.
The vocabulary stays padded (e.g. 50304 rows for GPT-2's 50257 tokens): the extra rows are never produced by the
tokenizer, and keeping them keeps the logits of real tokens identical.

Everything here reads tensors through DCP or safetensors: no pickled code is executed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from hybridpar.errors import CheckpointError
from hybridpar.models import ModelConfig

GPT2_KEYS = dict(norm="layernorm", position="learned", mlp="gelu", bias=True, tie_embeddings=True)
LLAMA_KEYS = dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False)


def family(cfg: ModelConfig) -> str:
    if all(getattr(cfg, k) == v for k, v in GPT2_KEYS.items()) and cfg.kv_heads == cfg.n_heads:
        return "gpt2"
    if all(getattr(cfg, k) == v for k, v in LLAMA_KEYS.items()):
        return "llama"
    raise CheckpointError(f"model {cfg.name} (norm={cfg.norm}, position={cfg.position}, mlp={cfg.mlp}, bias={cfg.bias}) "
                     f"matches neither GPT2LMHeadModel nor LlamaForCausalLM; export it with to-torch instead")


def _interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of each head reordered from pairs (0,1),(2,3),... to halves (0,2,4,...,1,3,5,...)."""
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, hd // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    hd = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(w.shape)


def to_hf(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
    """(transformers config, HF state dict) of a hybridpar model."""
    fam = family(cfg)
    out = {}
    if fam == "gpt2":
        from transformers import GPT2Config

        hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model,
                            n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.ffn_dim,
                            activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps, resid_pdrop=cfg.dropout,
                            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, tie_word_embeddings=True,
                            architectures=["GPT2LMHeadModel"])
        out["transformer.wte.weight"] = sd["tok_embeddings.weight"]
        out["transformer.wpe.weight"] = sd["pos_embeddings.weight"]
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[h + theirs + ".weight"], out[h + theirs + ".bias"] = sd[p + ours + ".weight"], sd[p + ours + ".bias"]
            qkv = [sd[p + f"attn.{n}.weight"] for n in ("wq", "wk", "wv")]
            out[h + "attn.c_attn.weight"] = torch.cat(qkv).t().contiguous()  # Conv1D: (in, out)
            out[h + "attn.c_attn.bias"] = torch.cat([sd[p + f"attn.{n}.bias"] for n in ("wq", "wk", "wv")])
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
                out[h + theirs + ".weight"] = sd[p + ours + ".weight"].t().contiguous()
                out[h + theirs + ".bias"] = sd[p + ours + ".bias"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["norm.weight"], sd["norm.bias"]
        out["lm_head.weight"] = sd["tok_embeddings.weight"]
        return hf_cfg, out
    from transformers import LlamaConfig

    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
                         max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                         rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
                         mlp_bias=False, architectures=["LlamaForCausalLM"])
    out["model.embed_tokens.weight"] = sd["tok_embeddings.weight"]
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out[h + "input_layernorm.weight"] = sd[p + "attn_norm.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "mlp_norm.weight"]
        out[h + "self_attn.q_proj.weight"] = _interleaved_to_halves(sd[p + "attn.wq.weight"], cfg.n_heads)
        out[h + "self_attn.k_proj.weight"] = _interleaved_to_halves(sd[p + "attn.wk.weight"], cfg.kv_heads)
        out[h + "self_attn.v_proj.weight"] = sd[p + "attn.wv.weight"]
        out[h + "self_attn.o_proj.weight"] = sd[p + "attn.wo.weight"]
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            out[h + f"mlp.{theirs}.weight"] = sd[p + f"mlp.{ours}.weight"]
    out["model.norm.weight"] = sd["norm.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    return hf_cfg, out


def from_hf(hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, hybridpar state dict) of a GPT2LMHeadModel or LlamaForCausalLM folder (config.json +
    model.safetensors). The config is named after the zoo family it belongs to, every field set explicitly."""
    from safetensors.torch import load_file

    cfg_file = Path(hf_dir) / "config.json"
    try:
        c = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_file} is not valid JSON ({e}); re-save the model with save_pretrained") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"{cfg_file} is not a transformers config (a JSON object); re-save the model")
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir} has no .safetensors weights; save the model with safe_serialization=True")
    hf = {}
    for f in files:
        try:
            hf.update(load_file(str(f)))
        except Exception as e:  # safetensors' own error type: a damaged or truncated file
            raise CheckpointError(f"{f} cannot be read as safetensors ({e}); re-save or re-download it") from None
    try:
        return _from_hf(c, hf, hf_dir)
    except CheckpointError:
        raise
    except KeyError as e:
        raise CheckpointError(f"{hf_dir}: config.json or the weights lack {e}; is it a complete GPT2LMHeadModel or "
                              f"LlamaForCausalLM save?") from None
    except (ValueError, TypeError) as e:  # a config value the model config refuses
        raise CheckpointError(f"{cfg_file}: {e}") from None


def _from_hf(c: dict, hf: dict, hf_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    sd = {}
    arch = (c.get("architectures") or [c.get("model_type")])[0]
    if c.get("model_type") == "gpt2":
        cfg = ModelConfig(name="gpt2-124m", n_layers=c["n_layer"], d_model=c["n_embd"], n_heads=c["n_head"],
                          ffn_hidden_size=c.get("n_inner") or 4 * c["n_embd"], vocab_size=c["vocab_size"],
                          max_seq_len=c["n_positions"], norm_eps=c["layer_norm_epsilon"], dropout=0.0, **GPT2_KEYS)
        pre = "transformer." if "transformer.wte.weight" in hf else ""
        sd["tok_embeddings.weight"] = hf[pre + "wte.weight"]
        sd["pos_embeddings.weight"] = hf[pre + "wpe.weight"]
        H = cfg.d_model
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"{pre}h.{i}."
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                sd[p + ours + ".weight"], sd[p + ours + ".bias"] = hf[h + theirs + ".weight"], hf[h + theirs + ".bias"]
            w, b = hf[h + "attn.c_attn.weight"].t(), hf[h + "attn.c_attn.bias"]
            for j, n in enumerate(("wq", "wk", "wv")):
                sd[p + f"attn.{n}.weight"] = w[j * H:(j + 1) * H].contiguous()
                sd[p + f"attn.{n}.bias"] = b[j * H:(j + 1) * H].contiguous()
            for ours, theirs in (("attn.wo", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj")):
                sd[p + ours + ".weight"] = hf[h + theirs + ".weight"].t().contiguous()
                sd[p + ours + ".bias"] = hf[h + theirs + ".bias"]
        sd["norm.weight"], sd["norm.bias"] = hf[pre + "ln_f.weight"], hf[pre + "ln_f.bias"]
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
    elif c.get("model_type") == "llama":
        cfg = ModelConfig(name="gpt-modern-1b", n_layers=c["num_hidden_layers"], d_model=c["hidden_size"],
                          n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads"),
                          ffn_hidden_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                          max_seq_len=c["max_position_embeddings"], norm_eps=c["rms_norm_eps"],
                          rope_theta=c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                          tie_embeddings=c.get("tie_word_embeddings", False), dropout=0.0, **LLAMA_KEYS)
        if c.get("head_dim") not in (None, cfg.head_dim):
            raise CheckpointError(f"{hf_dir}: head_dim {c['head_dim']} != hidden_size / heads = {cfg.head_dim}; "
                             f"hybridpar's GPT needs d_model = n_heads x head_dim")
        sd["tok_embeddings.weight"] = hf["model.embed_tokens.weight"]
        for i in range(cfg.n_layers):
            p, h = f"layers.{i}.", f"model.layers.{i}."
            sd[p + "attn_norm.weight"] = hf[h + "input_layernorm.weight"]
            sd[p + "mlp_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
            sd[p + "attn.wq.weight"] = _halves_to_interleaved(hf[h + "self_attn.q_proj.weight"], cfg.n_heads)
            sd[p + "attn.wk.weight"] = _halves_to_interleaved(hf[h + "self_attn.k_proj.weight"], cfg.kv_heads)
            sd[p + "attn.wv.weight"] = hf[h + "self_attn.v_proj.weight"]
            sd[p + "attn.wo.weight"] = hf[h + "self_attn.o_proj.weight"]
            for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
                sd[p + f"mlp.{ours}.weight"] = hf[h + f"mlp.{theirs}.weight"]
        sd["norm.weight"] = hf["model.norm.weight"]
        sd["lm_head.weight"] = hf.get("lm_head.weight", sd["tok_embeddings.weight"])
    else:
        raise CheckpointError(f"{hf_dir}: architecture {arch!r} is not supported; hybridpar converts GPT2LMHeadModel "
                         f"and LlamaForCausalLM")
    cfg.validate()
    return cfg, {k: v.contiguous() for k, v in sd.items()}


# -- one safetensors file, written tensor by tensor ---------------------------------------------------------------
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32"}


def write_safetensors_streaming(path: Path, metas: dict[str, tuple[torch.dtype, tuple]], load_tensor) -> None:
    """A safetensors file whose tensors are fetched one at a time by load_tensor(name): the header (names,
    dtypes, shapes, offsets) is known up front, so memory holds one tensor, not the model."""
    header, offset = {}, 0
    for name, (dtype, shape) in metas.items():
        n = int(np.prod(shape)) * torch.tensor([], dtype=dtype).element_size()
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, (dtype, shape) in metas.items():
            t = load_tensor(name).to(dtype).contiguous().reshape(shape)
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    tmp.rename(path)
