"""hybridpar's GPT model zoo: plain single-device PyTorch models, built on the meta device then initialised.

    >>> from hybridpar.models import list_models, get_model_config, build_model, count_params
    >>> cfg = get_model_config("gpt3-1.3b", max_seq_len=4096)
    >>> count_params(cfg)        # no memory used: counted on the meta device
    >>> model = build_model(get_model_config("tiny"), device="cpu")
"""

from __future__ import annotations

import difflib

import torch
from torch import nn

from .config import MODEL_FIELDS, ModelConfig
from .gpt import GPT
from .presets import GPT3_PAPER_PARAMS, PRESETS

__all__ = ["GPT", "ModelConfig", "GPT3_PAPER_PARAMS", "list_models", "get_model_config", "build_model",
           "count_params"]


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


def build_model(config: ModelConfig, device: torch.device | str = "meta", init: bool = True) -> GPT:
    """Build the model on the meta device (no memory, no init cost), then materialise it on `device` and run
    `init_weights()`. With device="meta" the model stays abstract (for counting or for sharding first)."""
    with torch.device("meta"):
        model = GPT(config)
    if str(device) != "meta":
        model.to_empty(device=device)
        if init:
            model.init_weights()
        else:
            model.tie_weights()
    return model


def count_params(model_or_config: nn.Module | ModelConfig, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (a tied embedding counts once). With exclude_embeddings, the token and
    position embeddings are left out (the LM head stays when it is not tied)."""
    model = build_model(model_or_config) if isinstance(model_or_config, ModelConfig) else model_or_config
    skip = set()
    if exclude_embeddings:
        skip = {id(p) for n, p in model.named_parameters() if n.startswith(("tok_embeddings", "pos_embeddings"))}
    seen, total = set(), 0
    for p in model.parameters():  # parameters() yields each shared Parameter once
        if id(p) not in skip and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
