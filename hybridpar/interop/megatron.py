"""Megatron-LM checkpoints <-> hybridpar models.

A Megatron-LM save directory holds `latest_checkpointed_iteration.txt` and one `iter_XXXXXXX/` per save, in one of
two formats:
- torch_dist (Megatron-LM's default): DCP shards + `.metadata`, `common.pt` (the non-tensor state, `args` among it)
  and `metadata.json`. Tensors are global (whatever the tensor-parallel size of the run), the blocks' tensors
  stacked along a leading layer axis under Transformer-Engine names (`decoder.layers.self_attention.linear_qkv.
  layer_norm_weight` is block i's attention norm at [i]).
- legacy torch: `mp_rank_XX/model_optim_rng.pt`, one torch.save file per tensor-parallel rank, each holding its
  partition: column-parallel layers split on rows, row-parallel on columns, the vocabulary on rows, SwiGLU's
  `linear_fc1` as that rank's [gate; up] halves, `linear_qkv` as whole query groups.

megatron-core's attention fuses Q, K, V per query group: for each of the nkv groups, its nh/nkv query heads, then
its K head, then its V head (hd rows each). RoPE rotates the two halves of each head unless `rotary_interleaved`;
hybridpar rotates interleaved pairs, so Q and K rows are permuted (as for Llama). `apply_layernorm_1p` stores norm
gains minus one. Nothing here runs code from the files: DCP metadata through hybridpar.checkpoint.safe_load's
checked reader, `.pt` files through torch's weights-only unpickler (`argparse.Namespace` and a named list of
Megatron-LM classes, made inert).
"""

from __future__ import annotations

import json
import re
from argparse import Namespace
from pathlib import Path

import torch

from hybridpar.interop.hf import _halves_to_interleaved, _interleaved_to_halves
from hybridpar.errors import CheckpointError
from hybridpar.models import ModelConfig, named_like_its_preset
from hybridpar.checkpoint.safe_load import load_plain_torch_file, read_metadata

# -- tensors: (our names, Megatron name with {i} for the block, how tensor-parallel ranks split it) ---------------
# Splits: rep (replicated), rows (column/vocab-parallel: dim 0), cols (row-parallel: dim 1), glu (each rank's
# [gate; up] rows), qkv (whole query groups per rank, on dim 0).
_L = "decoder.layers.{i}."
RULES = [
    (["tok_embeddings.weight"], "embedding.word_embeddings.weight", "rows"),
    (["pos_embeddings.weight"], "embedding.position_embeddings.weight", "rep"),
    (["layers.{i}.attn_norm.weight"], _L + "input_layernorm.weight", "rep"),
    (["layers.{i}.attn_norm.bias"], _L + "input_layernorm.bias", "rep"),
    (["layers.{i}.attn.wq.weight", "layers.{i}.attn.wk.weight", "layers.{i}.attn.wv.weight"],
     _L + "self_attention.linear_qkv.weight", "qkv"),
    (["layers.{i}.attn.wq.bias", "layers.{i}.attn.wk.bias", "layers.{i}.attn.wv.bias"],
     _L + "self_attention.linear_qkv.bias", "qkv"),
    (["layers.{i}.attn.wo.weight"], _L + "self_attention.linear_proj.weight", "cols"),
    (["layers.{i}.attn.wo.bias"], _L + "self_attention.linear_proj.bias", "rep"),
    (["layers.{i}.mlp_norm.weight"], _L + "pre_mlp_layernorm.weight", "rep"),
    (["layers.{i}.mlp_norm.bias"], _L + "pre_mlp_layernorm.bias", "rep"),
    (["layers.{i}.mlp.gate.weight", "layers.{i}.mlp.up.weight"], _L + "mlp.linear_fc1.weight", "glu"),
    (["layers.{i}.mlp.gate.bias", "layers.{i}.mlp.up.bias"], _L + "mlp.linear_fc1.bias", "glu"),
    (["layers.{i}.mlp.up.weight"], _L + "mlp.linear_fc1.weight", "rows"),
    (["layers.{i}.mlp.up.bias"], _L + "mlp.linear_fc1.bias", "rows"),
    (["layers.{i}.mlp.down.weight"], _L + "mlp.linear_fc2.weight", "cols"),
    (["layers.{i}.mlp.down.bias"], _L + "mlp.linear_fc2.bias", "rep"),
    (["norm.weight"], "decoder.final_layernorm.weight", "rep"),
    (["norm.bias"], "decoder.final_layernorm.bias", "rep"),
    (["lm_head.weight"], "output_layer.weight", "rows"),
]
# Transformer Engine's fused names (what torch_dist saves use, and legacy saves of the TE layer spec).
_TE_NAMES = {f"{ours}.{leaf}": f"{theirs}.layer_norm_{leaf}" for leaf in ("weight", "bias") for ours, theirs in
             (("input_layernorm", "self_attention.linear_qkv"), ("pre_mlp_layernorm", "mlp.linear_fc1"))}


def rules(cfg: ModelConfig):
    """(our names, Megatron name, split) for every tensor of a model of `cfg`, blocks expanded."""
    ours_present = set(_our_names(cfg))
    for ours, theirs, split in RULES:
        if (split == "glu") != (cfg.mlp == "swiglu") and "linear_fc1" in theirs:
            continue
        for i in (range(cfg.n_layers) if "{i}" in theirs else [None]):
            names = [o.format(i=i) for o in ours]
            if names[0] == "lm_head.weight" and cfg.tie_embeddings:
                continue
            if all(n in ours_present for n in names):
                yield names, theirs.format(i=i), split


def _our_names(cfg: ModelConfig) -> list[str]:
    from hybridpar.models import build_model

    return [n for n, _ in build_model(cfg, "meta", init=False).named_parameters()]


def stacked_name(name: str) -> tuple[str, int | None]:
    """A Megatron per-block name -> (torch_dist key with Transformer Engine's norm names, block index)."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return name, None
    rest = m.group(2)
    return "decoder.layers." + _TE_NAMES.get(rest, rest), int(m.group(1))


# -- Q/K/V and the MLP's first layer ------------------------------------------------------------------------------
def _split_qkv(t: torch.Tensor, cfg: ModelConfig, interleaved: bool) -> list[torch.Tensor]:
    groups, per = cfg.kv_heads, cfg.n_heads // cfg.kv_heads
    g = t.reshape(groups, (per + 2) * cfg.head_dim, *t.shape[1:])
    q, k, v = g.split([per * cfg.head_dim, cfg.head_dim, cfg.head_dim], dim=1)
    q, k, v = (x.reshape(-1, *t.shape[1:]) for x in (q, k, v))
    if cfg.position == "rope" and not interleaved:  # Megatron rotates halves, hybridpar interleaved pairs
        q, k = _halves_to_interleaved(q, cfg.n_heads), _halves_to_interleaved(k, cfg.kv_heads)
    return [q, k, v]


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """hybridpar's Q, K, V -> Megatron's fused linear_qkv with half-split RoPE rows (its default)."""
    if cfg.position == "rope":
        q, k = _interleaved_to_halves(q, cfg.n_heads), _interleaved_to_halves(k, cfg.kv_heads)
    parts = [x.reshape(cfg.kv_heads, -1, *q.shape[1:]) for x in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *q.shape[1:])


def _from_megatron_tensor(t: torch.Tensor, ours: list[str], split: str, cfg, interleaved: bool, one_p: bool):
    if split == "qkv":
        return _split_qkv(t, cfg, interleaved)
    if split == "glu":
        return list(t.chunk(2, dim=0))
    if one_p and "norm" in ours[0] and ours[0].endswith(".weight"):
        return [t + 1.0]  # apply_layernorm_1p (zero-centred gamma) stores gain - 1
    return [t]


def _merge_tp(parts: list[torch.Tensor], split: str) -> torch.Tensor:
    if split == "rep" or len(parts) == 1:
        return parts[0]
    if split in ("rows", "qkv"):
        return torch.cat(parts, dim=0)
    if split == "cols":
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]  # glu: rank r holds [gate_r; up_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


# -- the model's shape, from Megatron-LM's saved args ---------------------------------------------------------------
_REFUSED = [  # (argument, test on its value, why)
    ("num_experts", lambda v: v not in (None, 0, 1), "mixture-of-experts layers"),
    ("multi_latent_attention", bool, "multi-latent attention"),
    ("qk_layernorm", bool, "Q/K layer norms"),
    ("apply_residual_connection_post_layernorm", bool, "post-norm residuals"),
    ("squared_relu", bool, "the squared-ReLU MLP"),
    ("rotary_seq_len_interpolation_factor", lambda v: v not in (None, 1, 1.0), "RoPE position interpolation"),
    ("use_rope_scaling", bool, "RoPE scaling"),
    ("rotary_percent", lambda v: v not in (None, 1, 1.0), "partial RoPE"),
    ("num_layers_per_virtual_pipeline_stage", lambda v: v is not None, "virtual pipeline stages"),
]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def config_from_args(args: Namespace, vocab_rows: int, embedding_width: int, layers: int) -> ModelConfig:
    """ModelConfig of a Megatron-LM model, every field set; CheckpointError naming the argument hybridpar's GPT
    does not have, or one the tensors contradict (before anything is built: 10^9 layers grew memory unbounded)."""
    a = vars(args)
    for name, found in (("num_layers", layers), ("hidden_size", embedding_width)):
        if a.get(name) != found:
            raise CheckpointError(f"Megatron-LM argument {_flag(name)}={a.get(name)!r} but the saved tensors hold "
                                  f"{found}; the save's args and weights disagree")
    for name, refused, what in _REFUSED:
        if refused(a.get(name)):
            raise CheckpointError(f"Megatron-LM argument {_flag(name)}={a[name]!r} ({what}) has no counterpart in "
                                  f"hybridpar's GPT; convert a model trained without it")
    heads, hidden = a["num_attention_heads"], a["hidden_size"]
    if a.get("kv_channels") not in (None, hidden // heads):
        raise CheckpointError(f"Megatron-LM argument --kv-channels={a['kv_channels']} differs from hidden size / heads "
                              f"= {hidden // heads}; hybridpar's GPT needs d_model = n_heads x head_dim")
    position = {"learned_absolute": "learned", "rope": "rope"}.get(a.get("position_embedding_type", "learned_absolute"))
    if position is None:
        raise CheckpointError(f"Megatron-LM argument --position-embedding-type={a['position_embedding_type']!r} is not "
                              f"supported; hybridpar has learned_absolute and rope")
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(a.get("normalization", "LayerNorm"))
    if norm is None:
        raise CheckpointError(f"Megatron-LM argument --normalization={a['normalization']!r} is not supported; "
                              f"hybridpar has LayerNorm and RMSNorm")
    bias = bool(a.get("add_bias_linear", True))
    return named_like_its_preset(ModelConfig(
        name="gpt2-124m" if position == "learned" else "gpt-modern-1b",
        n_layers=a["num_layers"], d_model=hidden, n_heads=heads,
        n_kv_heads=a["num_query_groups"] if a.get("group_query_attention") else heads,
        ffn_hidden_size=a.get("ffn_hidden_size") or 4 * hidden, vocab_size=vocab_rows, vocab_from_tokenizer=False,
        max_seq_len=a.get("max_position_embeddings") or a["seq_length"], norm=norm,
        norm_eps=float(a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5))), position=position,
        rope_theta=float(a.get("rotary_base", 10000)), mlp="swiglu" if a.get("swiglu") else "gelu",
        gelu_approx="tanh" if a.get("openai_gelu") else "none", bias=bias,
        qkv_bias=bias or bool(a.get("add_qkv_bias")), norm_bias=norm == "layernorm", dropout=0.0,
        tie_embeddings=not a.get("untie_embeddings_and_output_weights", False)))


# Megatron-LM training flags -> hybridpar settings (docs/checkpoints.md), copied into from-megatron's config.yaml.
ARG_MAP = [
    ("tensor_model_parallel_size", "parallel.tp"), ("micro_batch_size", "train.micro_batch_size"),
    ("global_batch_size", "train.global_batch_size"), ("seq_length", "train.seq_len"), ("train_iters", "train.steps"),
    ("seed", "train.seed"), ("clip_grad", "train.grad_clip"), ("lr", "optim.lr"), ("min_lr", "optim.min_lr"),
    ("lr_warmup_iters", "optim.warmup_steps"), ("lr_decay_style", "optim.schedule"),
    ("weight_decay", "optim.weight_decay"), ("adam_beta1", "optim.beta1"), ("adam_beta2", "optim.beta2"),
    ("adam_eps", "optim.eps"),
]
_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "constant", "WSD": "wsd"}


def run_settings(args: Namespace) -> dict[str, dict]:
    """{section: {field: value}} of the train/optim settings in Megatron-LM's args (ARG_MAP)."""
    out: dict[str, dict] = {}
    for arg, target in ARG_MAP:
        section, field = target.split(".")
        value = getattr(args, arg, None)
        if section == "parallel" or value is None:
            continue
        if arg == "lr_decay_style":
            value = _SCHEDULES.get(value)
            if value is None:
                continue
        out.setdefault(section, {})[field] = value
    return out


# -- reading --------------------------------------------------------------------------------------------------------
def resolve_iteration_dir(path: Path, iteration: int | None = None) -> Path:
    """An iter_XXXXXXX directory from a Megatron-LM save directory (its latest, or `iteration`) or itself."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"--megatron {path} is not a directory; give a Megatron-LM save directory or one of its "
                              f"iter_XXXXXXX directories")
    if re.fullmatch(r"iter_\d{7}|release", path.name):
        return path
    if iteration is None:
        tracker = path / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            what = "is not a regular file" if tracker.exists() else "does not exist"
            raise CheckpointError(f"--megatron {path}: its latest_checkpointed_iteration.txt {what}; pass --iteration "
                                  f"N or an iter_XXXXXXX directory")
        with open(tracker, "rb") as f:  # (Megatron-LM writes a number or "release": a few bytes)
            text = f.read(64).decode(errors="replace").strip()
        if text == "release":
            return path / "release"
        if not (text.isascii() and text.isdigit() and len(text) <= 18):
            raise CheckpointError(f"{tracker} holds {text[:40]!r}, not an iteration number; pass --iteration N")
        iteration = int(text)
    out = path / f"iter_{iteration:07d}"
    if not out.is_dir():
        found = sorted(p.name for p in path.glob("iter_*"))
        raise CheckpointError(f"{out} does not exist (found: {', '.join(found) or 'none'}); pass another --iteration")
    return out


def _checked_args(args, source: Path) -> Namespace:
    if not isinstance(args, Namespace):
        raise CheckpointError(f"{source} holds no Megatron-LM args (saved without them?); hybridpar reads the "
                              f"model's shape from them")
    return args


def read_megatron(iter_dir: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Namespace, str]:
    """(config, hybridpar state dict in fp32, Megatron args, format) of one Megatron-LM iteration directory."""
    if (iter_dir / "metadata.json").is_file():
        return _read_torch_dist(iter_dir)
    if sorted(iter_dir.glob("mp_rank_*")):
        return _read_legacy(iter_dir)
    raise CheckpointError(f"{iter_dir} holds neither a torch_dist save (metadata.json) nor legacy mp_rank_XX/ "
                          f"directories")


def _convert(cfg, args, fetch) -> dict[str, torch.Tensor]:
    """Our state dict, fetch(Megatron name, split) giving each Megatron tensor."""
    interleaved, one_p = bool(getattr(args, "rotary_interleaved", False)), bool(getattr(args, "apply_layernorm_1p",
                                                                                        False))
    sd = {}
    for ours, theirs, split in rules(cfg):
        sd.update(zip(ours, _from_megatron_tensor(fetch(theirs, split).float(), ours, split, cfg, interleaved, one_p)))
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["tok_embeddings.weight"]
    return {k: v.contiguous() for k, v in sd.items()}


def _read_torch_dist(iter_dir: Path):
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from hybridpar.checkpoint.dcp import _safe_load
    from hybridpar.checkpoint.safe_load import SafeLoadPlanner

    try:
        info = json.loads((iter_dir / "metadata.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{iter_dir / 'metadata.json'} is not valid JSON ({e})") from None
    if not isinstance(info, dict) or info.get("sharded_backend") != "torch_dist":
        backend = info.get("sharded_backend") if isinstance(info, dict) else info
        raise CheckpointError(f"{iter_dir}: sharded backend {backend!r} is not supported; hybridpar reads torch_dist "
                              f"(and legacy torch) saves")
    common = load_plain_torch_file(iter_dir / "common.pt")
    args = _checked_args(common.get("args") if isinstance(common, dict) else None, iter_dir / "common.pt")
    # Megatron's non-tensor pieces (Transformer Engine extra state) are byte entries: allowed, never read.
    metadata = read_metadata(iter_dir, byte_entries_ok=lambda key: "_extra_state" in key)
    metas = {k: m for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    if "embedding.word_embeddings.weight" not in metas:
        raise CheckpointError(f"{iter_dir} holds no embedding.word_embeddings.weight: not a GPT model save")
    stacked = [m.size[0] for k, m in metas.items() if k.startswith("decoder.layers.")]  # (layers, ...) each
    cfg = config_from_args(args, *metas["embedding.word_embeddings.weight"].size[:2],
                           layers=max(stacked, default=0))
    keys = {stacked_name(theirs)[0] for _, theirs, _ in rules(cfg)}
    missing = sorted(keys - metas.keys())
    if missing:
        raise CheckpointError(f"{iter_dir} lacks {missing[0]} (and {len(missing) - 1} more) that its args imply; "
                              f"was it saved by a different model?")
    state = {k: torch.empty(tuple(metas[k].size), dtype=metas[k].properties.dtype) for k in keys}
    _safe_load(state, iter_dir, SafeLoadPlanner(), metadata=metadata, no_dist=True)

    def fetch(name, split):
        key, i = stacked_name(name)
        return state[key] if i is None else state[key][i]

    return cfg, _convert(cfg, args, fetch), args, "torch_dist"


def _read_legacy(iter_dir: Path):
    ranks = sorted(iter_dir.glob("mp_rank_*"))
    if any(not re.fullmatch(r"mp_rank_\d\d", p.name) for p in ranks):
        raise CheckpointError(f"{iter_dir} holds pipeline-parallel partitions ({ranks[-1].name}): hybridpar merges "
                              f"tensor-parallel ranks only; save with --pipeline-model-parallel-size 1 or torch_dist")
    parts = [load_plain_torch_file(p / "model_optim_rng.pt") for p in ranks]
    args = _checked_args(parts[0].get("args") if isinstance(parts[0], dict) else None, ranks[0])
    tp = getattr(args, "tensor_model_parallel_size", 1)
    if tp != len(ranks) or [p.name for p in ranks] != [f"mp_rank_{r:02d}" for r in range(tp)]:
        raise CheckpointError(f"{iter_dir} has {len(ranks)} mp_rank_XX directories but its args say "
                              f"--tensor-model-parallel-size={tp}; the save is incomplete")
    models = []
    for p, part in zip(ranks, parts):
        model = part.get("model") if isinstance(part, dict) else None
        if not isinstance(model, dict):
            raise CheckpointError(f"{p / 'model_optim_rng.pt'} holds no 'model' state dict")
        if any(k.startswith("language_model.") for k in model):
            raise CheckpointError(f"{p / 'model_optim_rng.pt'} uses the pre-megatron-core layout (language_model.*); "
                                  f"re-save it with megatron-core models (--use-mcore-models) first")
        models.append(model)
    vocab_rows = sum(m["embedding.word_embeddings.weight"].shape[0] for m in models)
    blocks = {int(k.split(".")[2]) for k in models[0] if re.match(r"decoder\.layers\.\d+\.", k)}
    cfg = config_from_args(args, vocab_rows, models[0]["embedding.word_embeddings.weight"].shape[1],
                           layers=max(blocks, default=-1) + 1)

    def fetch(name, split):
        short, i = stacked_name(name)  # legacy saves use either the local or the Transformer Engine names
        te = name if i is None else f"decoder.layers.{i}." + short[len("decoder.layers."):]
        got = [m.get(name, m.get(te)) for m in models]
        if any(not isinstance(g, torch.Tensor) for g in got):
            raise CheckpointError(f"{iter_dir}: {name} is missing from a tensor-parallel rank's model_optim_rng.pt")
        return _merge_tp(got, split)

    return cfg, _convert(cfg, args, fetch), args, f"torch (legacy, {tp} tensor-parallel rank(s))"


# -- writing ----------------------------------------------------------------------------------------------------------
def megatron_args(cfg: ModelConfig, train=None, iteration: int = 0) -> Namespace:
    """The args Megatron-LM needs to rebuild `cfg` (with `train`, its batch and schedule); RoPE half-split."""
    a = dict(num_layers=cfg.n_layers, hidden_size=cfg.d_model, num_attention_heads=cfg.n_heads,
             group_query_attention=cfg.kv_heads != cfg.n_heads, num_query_groups=cfg.kv_heads,
             kv_channels=cfg.head_dim, ffn_hidden_size=cfg.ffn_dim, padded_vocab_size=cfg.vocab_size,
             make_vocab_size_divisible_by=1, max_position_embeddings=cfg.max_seq_len,
             position_embedding_type={"learned": "learned_absolute", "rope": "rope"}[cfg.position],
             rotary_base=int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta,
             rotary_percent=1.0, rotary_interleaved=False, normalization={"layernorm": "LayerNorm",
                                                                          "rmsnorm": "RMSNorm"}[cfg.norm],
             norm_epsilon=cfg.norm_eps, apply_layernorm_1p=False, swiglu=cfg.mlp == "swiglu",
             openai_gelu=cfg.mlp == "gelu" and cfg.gelu_approx == "tanh", add_bias_linear=cfg.bias,
             add_qkv_bias=cfg.attn_bias, untie_embeddings_and_output_weights=not cfg.tie_embeddings,
             hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout, tensor_model_parallel_size=1,
             pipeline_model_parallel_size=1, num_experts=None, params_dtype=torch.float32, ckpt_format="torch_dist",
             iteration=iteration)
    if train is not None:
        a.update(seq_length=train.seq_len, micro_batch_size=train.micro_batch_size, global_batch_size=
                 train.global_batch_size, train_iters=train.steps, seed=train.seed)
    return Namespace(**a)


def to_megatron_state(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict:
    """torch_dist tensors (stacked, Transformer Engine names) of a hybridpar state dict; biases hybridpar's model
    lacks (LayerNorm without bias, Q/K/V bias beside linear biases) are written as zeros."""
    out: dict[str, list] = {}
    full = ModelConfig(**{**vars(cfg), "norm_bias": cfg.norm == "layernorm",
                          "qkv_bias": cfg.bias or cfg.attn_bias})  # the tensors Megatron's args will imply
    def tensor(name):  # ours, or a zero bias with one entry per output row of its layer's weight
        if name in sd:
            return sd[name]
        weight = sd[name.replace(".bias", ".weight")]
        return torch.zeros(weight.shape[0], dtype=weight.dtype)

    for ours, theirs, split in rules(full):
        ts = [tensor(o) for o in ours]
        t = _fuse_qkv(*ts, cfg) if split == "qkv" else torch.cat(ts) if split == "glu" else ts[0]
        key, i = stacked_name(theirs)
        if i is None:
            out[key] = t
        else:
            out.setdefault(key, []).append(t)
    state = {k: torch.stack(v) if isinstance(v, list) else v for k, v in out.items()}
    # megatron-core loads an `_extra_state` object per linear layer of each block (Transformer Engine's FP8 state;
    # None without it), one byte entry per block, key/shard_<block>_<blocks>, holding torch.save([state]).
    for key in [k for k in state if k.startswith("decoder.layers.") and re.search(r"linear_\w+\.weight$", k)]:
        for i in range(cfg.n_layers):
            state[f"{key[:-len('weight')]}_extra_state/shard_{i}_{cfg.n_layers}"] = [None]
    return state
