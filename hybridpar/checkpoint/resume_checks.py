"""What a resume must keep: the checkpoint's saved config and run state, read safely, and the checks that refuse a
resume into another model or onto other data (the consumed-samples position only means something for the same
seed, sequence length, data, split and tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from hybridpar.data.record import DATA_FIELDS, STAGE_FIELDS
from hybridpar.errors import CheckpointError


def read_checkpoint_config(path: Path) -> dict | None:
    """The resolved config a checkpoint (or run dir) was saved with, as a plain dict; None if it has none. YAML is
    read with the safe loader (no Python tags); a damaged file is a one-line CheckpointError."""
    import yaml

    cfg_file = Path(path) / "config.yaml"
    if not cfg_file.is_file():
        return None
    try:
        saved = yaml.load(cfg_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        first = str(e).strip().splitlines()[0]
        raise CheckpointError(f"{cfg_file} is not a config hybridpar wrote ({first}); restore it from the run's "
                              f"config.yaml or use another checkpoint") from None
    if not isinstance(saved, dict) or not all(isinstance(saved.get(k, {}), dict) for k in ("model", "train", "data")):
        raise CheckpointError(f"{cfg_file} is not a config hybridpar wrote (not a mapping of sections); restore it "
                              f"from the run's config.yaml or use another checkpoint")
    return saved


def data_key(cfg) -> int:
    """CRC-32 of the data-defining settings (DATA_FIELDS): saved inside the DCP checkpoint itself, so a resume onto
    other data is caught even when the checkpoint's config.yaml, which names the fields, is gone."""
    import zlib

    fields = DATA_FIELDS if cfg.data.stages else DATA_FIELDS[:-len(STAGE_FIELDS)]
    return zlib.crc32(json.dumps([getattr(getattr(cfg, a), b) for a, b in fields]).encode())


def data_changes(path: Path, cfg, tokenizer_fingerprint: str | None) -> list[str]:
    """The data-defining settings in which `cfg` differs from checkpoint `path`, as 'field: checkpoint X vs now Y'."""
    saved = read_checkpoint_config(path) or {}
    from hybridpar.config.cli import to_dict

    now = to_dict(cfg)
    diff = [f"{a}.{b}: checkpoint {saved[a][b]!r} vs now {now[a][b]!r}" for a, b in DATA_FIELDS
            if b in saved.get(a, {}) and saved[a][b] != now[a][b]]
    was = read_run_state(path).get("tokenizer_fingerprint")
    if was and tokenizer_fingerprint and was != tokenizer_fingerprint:
        diff.append(f"tokenizer contents: checkpoint {was[:12]} vs now {tokenizer_fingerprint[:12]}")
    return diff


def read_run_state(path: Path) -> dict:
    """run_state.json of a checkpoint ({} if absent); a damaged one is a one-line CheckpointError."""
    f = Path(path) / "run_state.json"
    if not f.is_file():
        return {}
    try:
        state = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{f} is damaged ({e}); delete it to resume without the W&B run id, or use another "
                              f"checkpoint") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} is damaged (not a JSON object); delete it to resume without the W&B run id")
    for key, kind in RUN_STATE_TYPES.items():
        v = state.get(key)
        if v is not None and (not isinstance(v, kind) or isinstance(v, bool) or (v < 1 if kind is int else not v)):
            want = "a positive int" if kind is int else "a non-empty string"
            raise CheckpointError(f"{f} is damaged ({key} is {v!r}, not {want}); delete it to resume without the W&B "
                                  f"run id, or use another checkpoint")
    return state


RUN_STATE_TYPES = {"wandb_id": str, "tokenizer_fingerprint": str, "cpu_threads": int}  # each may also be null


def check_model_config(path: Path, cfg) -> None:
    """A checkpoint of another architecture fails here, naming the fields that differ."""
    saved = (read_checkpoint_config(path) or {}).get("model", {})
    from hybridpar.config.cli import to_dict

    now = to_dict(cfg)["model"]
    not_shape = ("dropout", "init_std", "name", "vocab_from_tokenizer", "vocab_multiple")
    shape_fields = [k for k in now if k not in not_shape]
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in shape_fields
            if k in saved and saved[k] != now[k]]
    if diff:
        raise CheckpointError(f"checkpoint {path} holds a different model ({'; '.join(diff)}); load it with the "
                              f"same model config (its config.yaml), or start a new run with --run.name NAME")


def stage_origin(path: Path, cfg, plan, saved_origin, next_batch: int):
    """Where a staged run's sampler starts when it resumes from checkpoint `path` before 0-based global batch
    `next_batch` (hybridpar.data.stages): the checkpoint's own origin (stage_origin in its trainer state) when the
    stages and seed are those it was saved with; after an allowed change, (next_batch, each source's count there
    under the checkpoint's stages), a stream (source, seq_len) new to the run starting at 0. None: from batch 0,
    no origin."""
    import numpy as np

    from hybridpar.data.stages import StagePlan, StageSampler

    saved = read_checkpoint_config(path) or {}  # (none: the data key vouched that nothing changed)
    old_stages = saved.get("data", {}).get("stages", []) if saved else list(cfg.data.stages)
    old_seed = saved.get("train", {}).get("seed", cfg.train.seed)
    origin = None if saved_origin is None else (int(saved_origin[0]), np.asarray(saved_origin[1:], np.int64))
    if list(old_stages) == list(cfg.data.stages) and old_seed == cfg.train.seed:
        return origin if origin is not None and origin[0] > 0 else None
    counts = {}
    if old_stages:
        old = StagePlan.parse(old_stages, cfg.train.global_batch_size, saved.get("train", {}).get("seq_len",
                                                                                                 cfg.train.seq_len))
        if origin is not None and len(origin[1]) != len(old.streams):
            origin = None
        drawn = StageSampler(old, old_seed, cfg.train.global_batch_size, origin).counts_before(next_batch)
        counts = dict(zip(old.streams, drawn.tolist()))
    return next_batch, np.array([counts.get(s, 0) for s in plan.streams], np.int64)

