"""hybridpar's GPT model zoo: plain single-device PyTorch models, built on the meta device then initialised.

    >>> from hybridpar.models import list_models, get_model_config, build_model, count_params
    >>> cfg = get_model_config("gpt3-1.3b", max_seq_len=4096)
    >>> count_params(cfg)        # no memory used: counted on the meta device
    >>> model = build_model(get_model_config("tiny"), device="cpu")
"""

from __future__ import annotations

import difflib
from dataclasses import replace

import torch
from torch import nn

from .config import MODEL_FIELDS, ModelConfig
from .gpt import GPT
from .presets import GPT3_PAPER_PARAMS, PRESETS

__all__ = ["GPT", "ModelConfig", "GPT3_PAPER_PARAMS", "list_models", "get_model_config", "build_model",
           "count_params", "load_pretrained", "named_like_its_preset"]


def list_models() -> list[str]:
    """Names of the zoo's presets, in zoo order."""
    return list(PRESETS)


def get_model_config(name: str, **overrides) -> ModelConfig:
    """The preset `name` with `overrides` (ModelConfig field names) applied; validated."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=3, cutoff=0.4)
        hint = f" did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"unknown model {name!r};{hint} choose one of: {', '.join(PRESETS)}")
    bad = [k for k in overrides if k not in MODEL_FIELDS]
    if bad:
        raise ValueError(f"unknown model field(s) {bad}; valid: {', '.join(MODEL_FIELDS)}")
    return ModelConfig(**{**PRESETS[name], **overrides, "name": name})


def named_like_its_preset(config: ModelConfig) -> ModelConfig:
    """`config` named after the zoo preset with its shape (layers, widths, heads, norm, positions, MLP, biases,
    tying), when there is one; else as it is. An imported model then says what it is (a 1.3B GPT-3 is
    gpt3-1.3b, not the family's first preset)."""
    shape = ("n_layers", "d_model", "n_heads", "kv_heads", "ffn_dim", "norm", "position", "mlp", "gelu_approx", "bias",
             "attn_bias", "ln_bias", "tie_embeddings")
    for name in PRESETS:
        preset = get_model_config(name)
        if all(getattr(preset, f) == getattr(config, f) for f in shape):
            return replace(config, name=name)
    return config


def build_model(config: ModelConfig, device: torch.device | str = "meta", init: bool = True, seed: int = 0) -> GPT:
    """Build the model on the meta device (no memory, no init cost), then materialise it on `device` and run
    `init_weights(seed)`. With device="meta" the model stays abstract (for counting or for sharding first)."""
    with torch.device("meta"):
        model = GPT(config)
    if str(device) != "meta":
        model.to_empty(device=device)
        if init:
            model.init_weights(seed)
        else:
            model.tie_weights()
    return model


def count_params(model_or_config: nn.Module | ModelConfig) -> int:
    """Number of distinct parameters (a tied embedding counts once; parameters() yields each shared one once)."""
    model = build_model(model_or_config) if isinstance(model_or_config, ModelConfig) else model_or_config
    return sum(p.numel() for p in model.parameters())


def load_pretrained(path, device: torch.device | str = "cpu") -> GPT:
    """A ready model (eval mode) from a consolidated export: PATH/config.yaml (its `model` section) and
    PATH/model.safetensors, as `launch/convert_checkpoint.py to-torch` writes them. No pickle is read."""
    from pathlib import Path

    import yaml
    from safetensors.torch import load_file

    path = Path(path)
    fields = (yaml.safe_load((path / "config.yaml").read_text()) or {}).get("model", {})
    cfg = ModelConfig(**{k: v for k, v in fields.items() if k in MODEL_FIELDS})
    model = build_model(cfg, device=device)  # init computes the RoPE tables (buffers, not in the file)
    state = load_file(str(path / "model.safetensors"), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (cfg.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"{path}/model.safetensors does not match its config.yaml: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.tie_weights()
    return model.eval()
