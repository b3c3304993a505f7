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

from hybridpar.checkpoint.layout import regular_file_of
from hybridpar.errors import CheckpointError
from hybridpar.models import ModelConfig, build_model, named_like_its_preset

GPT2_KEYS = dict(norm="layernorm", position="learned", mlp="gelu", gelu_approx="tanh", bias=True,
                 tie_embeddings=True)
LLAMA_KEYS = dict(norm="rmsnorm", position="rope", mlp="swiglu", bias=False)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer.txt")  # what hybridpar's tokenizers save


def family(cfg: ModelConfig) -> str:
    if (all(getattr(cfg, k) == v for k, v in GPT2_KEYS.items()) and cfg.kv_heads == cfg.n_heads
            and cfg.attn_bias and cfg.ln_bias):
        return "gpt2"
    if all(getattr(cfg, k) == v for k, v in LLAMA_KEYS.items()) and not cfg.attn_bias:
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


# -- the mapping, written once per family and used in both directions ---------------------------------------------
# A rule: (our names, their name, transform). A transform is a pair of functions of (tensors, cfg): `to` makes their
# tensor from ours, `back` makes our tensors (a list) from theirs. {i} stands for the block index.
SAME = (lambda ts, cfg: ts[0], lambda t, cfg: [t])
CONV1D = (lambda ts, cfg: ts[0].t(), lambda t, cfg: [t.t()])  # GPT-2's Conv1D stores (in, out)
FUSED_QKV_CONV1D = (lambda ts, cfg: torch.cat(ts).t(), lambda t, cfg: list(t.t().split(cfg.d_model)))
FUSED_QKV_BIAS = (lambda ts, cfg: torch.cat(ts), lambda t, cfg: list(t.split(cfg.d_model)))
# RoPE: hybridpar rotates interleaved pairs, transformers' Llama rotates halves; the rows of q and k are permuted.
ROPE_Q = (lambda ts, cfg: _interleaved_to_halves(ts[0], cfg.n_heads),
          lambda t, cfg: [_halves_to_interleaved(t, cfg.n_heads)])
ROPE_K = (lambda ts, cfg: _interleaved_to_halves(ts[0], cfg.kv_heads),
          lambda t, cfg: [_halves_to_interleaved(t, cfg.kv_heads)])

_QKV = ["layers.{i}.attn.wq", "layers.{i}.attn.wk", "layers.{i}.attn.wv"]
TENSOR_RULES = {
    "gpt2": [
        (["tok_embeddings.weight"], "transformer.wte.weight", SAME),
        (["pos_embeddings.weight"], "transformer.wpe.weight", SAME),
        (["layers.{i}.attn_norm.weight"], "transformer.h.{i}.ln_1.weight", SAME),
        (["layers.{i}.attn_norm.bias"], "transformer.h.{i}.ln_1.bias", SAME),
        ([n + ".weight" for n in _QKV], "transformer.h.{i}.attn.c_attn.weight", FUSED_QKV_CONV1D),
        ([n + ".bias" for n in _QKV], "transformer.h.{i}.attn.c_attn.bias", FUSED_QKV_BIAS),
        (["layers.{i}.attn.wo.weight"], "transformer.h.{i}.attn.c_proj.weight", CONV1D),
        (["layers.{i}.attn.wo.bias"], "transformer.h.{i}.attn.c_proj.bias", SAME),
        (["layers.{i}.mlp_norm.weight"], "transformer.h.{i}.ln_2.weight", SAME),
        (["layers.{i}.mlp_norm.bias"], "transformer.h.{i}.ln_2.bias", SAME),
        (["layers.{i}.mlp.up.weight"], "transformer.h.{i}.mlp.c_fc.weight", CONV1D),
        (["layers.{i}.mlp.up.bias"], "transformer.h.{i}.mlp.c_fc.bias", SAME),
        (["layers.{i}.mlp.down.weight"], "transformer.h.{i}.mlp.c_proj.weight", CONV1D),
        (["layers.{i}.mlp.down.bias"], "transformer.h.{i}.mlp.c_proj.bias", SAME),
        (["norm.weight"], "transformer.ln_f.weight", SAME),
        (["norm.bias"], "transformer.ln_f.bias", SAME),
    ],
    "llama": [
        (["tok_embeddings.weight"], "model.embed_tokens.weight", SAME),
        (["layers.{i}.attn_norm.weight"], "model.layers.{i}.input_layernorm.weight", SAME),
        (["layers.{i}.attn.wq.weight"], "model.layers.{i}.self_attn.q_proj.weight", ROPE_Q),
        (["layers.{i}.attn.wk.weight"], "model.layers.{i}.self_attn.k_proj.weight", ROPE_K),
        (["layers.{i}.attn.wv.weight"], "model.layers.{i}.self_attn.v_proj.weight", SAME),
        (["layers.{i}.attn.wo.weight"], "model.layers.{i}.self_attn.o_proj.weight", SAME),
        (["layers.{i}.mlp_norm.weight"], "model.layers.{i}.post_attention_layernorm.weight", SAME),
        (["layers.{i}.mlp.gate.weight"], "model.layers.{i}.mlp.gate_proj.weight", SAME),
        (["layers.{i}.mlp.up.weight"], "model.layers.{i}.mlp.up_proj.weight", SAME),
        (["layers.{i}.mlp.down.weight"], "model.layers.{i}.mlp.down_proj.weight", SAME),
        (["norm.weight"], "model.norm.weight", SAME),
        (["lm_head.weight"], "lm_head.weight", SAME),  # untied only (see _rules)
    ],
}
# Config fields: (ours, theirs). Fixed values of each family (architecture, activation) are in _hf_config.
CONFIG_FIELDS = {
    "gpt2": [("n_layers", "n_layer"), ("d_model", "n_embd"), ("n_heads", "n_head"), ("ffn_hidden_size", "n_inner"),
             ("vocab_size", "vocab_size"), ("max_seq_len", "n_positions"), ("norm_eps", "layer_norm_epsilon")],
    "llama": [("n_layers", "num_hidden_layers"), ("d_model", "hidden_size"), ("n_heads", "num_attention_heads"),
              ("n_kv_heads", "num_key_value_heads"), ("ffn_hidden_size", "intermediate_size"),
              ("vocab_size", "vocab_size"), ("max_seq_len", "max_position_embeddings"), ("norm_eps", "rms_norm_eps"),
              ("rope_theta", "rope_theta"), ("tie_embeddings", "tie_word_embeddings")],
}


def _rules(fam: str, cfg: ModelConfig):
    """The family's rules expanded over the blocks; a tied LM head has no rule of its own."""
    for ours, theirs, transform in TENSOR_RULES[fam]:
        if ours == ["lm_head.weight"] and cfg.tie_embeddings:
            continue
        for i in (range(cfg.n_layers) if "{i}" in theirs else [None]):
            yield [o.format(i=i) for o in ours], theirs.format(i=i), transform


def _hf_config(fam: str, cfg: ModelConfig):
    values = {theirs: getattr(cfg, ours) for ours, theirs in CONFIG_FIELDS[fam]}
    values.update(bos_token_id=None, eos_token_id=None)  # the run's own end of document, set by the exporter: not
    #                                   GPT-2's 50256, which transformers warns is outside a smaller vocabulary
    if fam == "gpt2":
        from transformers import GPT2Config

        values["n_inner"] = cfg.ffn_dim
        return GPT2Config(**values, activation_function="gelu_new", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                          attn_pdrop=cfg.dropout, tie_word_embeddings=True, architectures=["GPT2LMHeadModel"])
    from transformers import LlamaConfig

    values["num_key_value_heads"] = cfg.kv_heads
    return LlamaConfig(**values, head_dim=cfg.head_dim, hidden_act="silu", attention_bias=False, mlp_bias=False,
                       architectures=["LlamaForCausalLM"])


def hf_export_plan(cfg: ModelConfig, our_metas: dict[str, tuple[torch.dtype, tuple]]):
    """(transformers config, {their name: (dtype, shape)}, {their name: (our names, make)}) for a streaming export:
    their shapes come from running each rule's transform on meta tensors of our shapes, and make(tensors) builds
    one of their tensors from ours, so an exporter holds one tensor (or one fused Q/K/V) at a time. A tied LM head
    is left out (transformers re-ties it)."""
    fam = family(cfg)
    metas, sources = {}, {}
    for ours, theirs, (to, _) in _rules(fam, cfg):
        probe = to([torch.empty(our_metas[o][1], dtype=our_metas[o][0], device="meta") for o in ours], cfg)
        metas[theirs] = (probe.dtype, tuple(probe.shape))
        sources[theirs] = (ours, lambda ts, to=to: to(ts, cfg))
    return _hf_config(fam, cfg), metas, sources


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
    arch = (c.get("architectures") or [c.get("model_type")])[0]
    fam = {"gpt2": "gpt2", "llama": "llama"}.get(c.get("model_type"))
    if fam is None:
        raise CheckpointError(f"{hf_dir}: architecture {arch!r} is not supported; hybridpar converts GPT2LMHeadModel "
                              f"and LlamaForCausalLM")
    fields = {ours: c[theirs] for ours, theirs in CONFIG_FIELDS[fam] if theirs in c and c[theirs] is not None}
    if fam == "gpt2":
        fields.setdefault("ffn_hidden_size", 4 * fields["d_model"])
        cfg = named_like_its_preset(ModelConfig(name="gpt2-124m", dropout=0.0, vocab_from_tokenizer=False,
                                                **{**fields, **GPT2_KEYS}))
        if "transformer.wte.weight" not in hf:  # saved from GPT2Model (no "transformer." prefix)
            hf = {"transformer." + k: v for k, v in hf.items()}
    else:
        fields.setdefault("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        fields.setdefault("tie_embeddings", False)
        cfg = named_like_its_preset(ModelConfig(name="gpt-modern-1b", dropout=0.0, vocab_from_tokenizer=False,
                                                **{**fields, **LLAMA_KEYS}))
        if c.get("head_dim") not in (None, cfg.head_dim):
            raise CheckpointError(f"{hf_dir}: head_dim {c['head_dim']} != hidden_size / heads = {cfg.head_dim}; "
                                  f"hybridpar's GPT needs d_model = n_heads x head_dim")
    for name, t in hf.items():
        if name.endswith(UNUSED_HF_BUFFERS):
            continue
        if not t.is_floating_point():
            raise CheckpointError(f"{hf_dir}: {name} holds {str(t.dtype).removeprefix('torch.')} values, not weights "
                                  f"(a float dtype); the file is damaged or not a model's weights")
        if not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{hf_dir}: {name} holds NaN or infinite values; a model trained from them "
                                  f"learns nothing: use another save")
    sd, used = {}, set()
    for ours, theirs, (_, back) in _rules(fam, cfg):
        try:
            sd.update(zip(ours, back(hf[theirs], cfg)))
        except RuntimeError as e:  # a reshape the config's sizes cannot make of this tensor
            raise CheckpointError(f"{hf_dir}: {theirs} of shape {list(hf[theirs].shape)} does not fit config.json "
                                  f"({str(e).splitlines()[0]}); the config and the weights disagree") from None
        used.add(theirs)
    if cfg.tie_embeddings or "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
        used |= {"lm_head.weight"}  # a tied head's copy, when the save holds one
    cfg.validate()
    _check_against_model(hf_dir, cfg, sd, [k for k in hf if k not in used and not k.endswith(UNUSED_HF_BUFFERS)])
    return cfg, {k: v.contiguous() for k, v in sd.items()}


UNUSED_HF_BUFFERS = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")  # recomputed, not weights


def _check_against_model(hf_dir: Path, cfg: ModelConfig, sd: dict, unused: list[str]) -> None:
    """config.json is checked against the tensors: every weight used, each of the shape the model needs; else one
    line names the first that is not (a wrong n_layer dropped blocks, a wrong n_embd dropped wv, at exit 0)."""
    if unused:
        raise CheckpointError(f"{hf_dir}: {unused[0]} (and {len(unused) - 1} more) is not used by the model "
                              f"config.json describes ({cfg.n_layers} layers, d_model {cfg.d_model}); the config and "
                              f"the weights disagree" if len(unused) > 1 else
                              f"{hf_dir}: {unused[0]} is not used by the model config.json describes; the config and "
                              f"the weights disagree")
    for name, p in build_model(cfg, device="meta").state_dict().items():
        if name in sd and tuple(sd[name].shape) != tuple(p.shape):
            raise CheckpointError(f"{hf_dir}: {name} comes out as {list(sd[name].shape)} but the model config.json "
                                  f"describes needs {list(p.shape)}; the config and the weights disagree")


def export_hf_tokenizer(ckpt: Path, out: Path, max_len: int) -> tuple[int | None, str]:
    """Write the run's tokenizer for transformers: a tokenizer.json run's as a fast tokenizer that
    AutoTokenizer.from_pretrained(out) loads, with its end-of-document token as eos, bos and pad (hybridpar's
    tokenizers have no separate padding token); a SentencePiece run's model file as is. Returns (end-of-document id,
    what was written); the id is None for the byte tokenizer, which transformers has no class for."""
    from hybridpar.data.tokenizer import load_tokenizer

    if (ckpt / "tokenizer.json").is_file():  # train-bpe, bpe:PATH, gpt2:DIR
        from transformers import PreTrainedTokenizerFast

        run_tok = load_tokenizer(f"bpe:{regular_file_of(ckpt, 'tokenizer.json')}")  # the run's end-of-document rule
        eod, text = run_tok.eod_id, run_tok.tok.id_to_token(run_tok.eod_id)
        PreTrainedTokenizerFast(tokenizer_object=run_tok.tok, eos_token=text, bos_token=text, pad_token=text,
                                model_max_length=max_len).save_pretrained(out)
        return eod, f"tokenizer (end of document {text!r} = id {eod})"
    if (ckpt / "tokenizer.model").is_file():  # sentencepiece:MODEL: its ids are exported, the model file copied
        import shutil

        model = regular_file_of(ckpt, "tokenizer.model")
        eod = load_tokenizer(f"sentencepiece:{model}").eod_id
        shutil.copyfile(model, out / "tokenizer.model")
        # transformers 5 builds a tokenizer from a SentencePiece model only through protobuf-based conversion, which
        # hybridpar does not depend on: the file is there for sentencepiece (or a converted tokenizer) to load.
        return eod, f"SentencePiece model copied as tokenizer.model (end of document id {eod}); not an AutoTokenizer"
    return None, "no tokenizer (the byte tokenizer has no transformers class; ids are the UTF-8 bytes, eos 0)"


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
    header["__metadata__"] = {"format": "pt"}  # what transformers expects of a PyTorch safetensors file
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
