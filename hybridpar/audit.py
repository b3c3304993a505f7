"""A finished (or running) run's provenance ledger, opened from its run directory: the data settings of its
config.yaml, the position of its latest checkpoint and the batches its run dir recorded as skipped, and the data
built as training built it (hybridpar.data.provenance holds the ledger's arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.config.data import merge_windows
from hybridpar.data.provenance import Ledger
from hybridpar.errors import DataError


def open_ledger(run_dir: Path) -> Ledger:
    """The ledger of the run in `run_dir`: its config.yaml (the data settings), its latest checkpoint's position
    (steps, skipped windows) and the windows its run dir recorded since, and the data built as training built it
    (megatron-core's index caches in data.cache_dir; one process, no model, no GPU)."""
    from hybridpar.checkpoint.dcp import read_trainer_state
    from hybridpar.checkpoint.layout import latest_checkpoint
    from hybridpar.checkpoint.rewind import read_skipped
    from hybridpar.config.cli import load_config
    from hybridpar.data.dataset import build_training_data, load_data_tokenizer, prepare_builtin
    from hybridpar.data.stages import StagePlan
    from hybridpar.errors import ConfigError

    run_dir = Path(run_dir)
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ConfigError(f"{run_dir} holds no config.yaml: give the run directory of a hybridpar run (--run.dir)")
    cfg = load_config(["--config", str(config)])
    cfg = replace(cfg, train=replace(cfg.train, device="cpu", eval_interval=0))
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigError(f"{run_dir} holds no complete checkpoint: its steps are known from checkpoints only")
    state = read_trainer_state(latest)
    origin = state.get("stage_origin")
    if origin is not None and int(origin[0]) > 0:
        raise DataError(f"{run_dir} changed its data.stages on a resume at batch {int(origin[0]) + 1}: the batches "
                        f"before it were drawn from other stages, which its config.yaml no longer holds")
    windows, _ = read_skipped(run_dir)
    windows = merge_windows([tuple(w) for w in state["skip_windows"]] + list(cfg.data.skip_windows) + windows)
    own_group = not dist.is_initialized()
    if own_group:  # (megatron-core's blends ask for the rank)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    d, t = cfg.data, cfg.train
    try:
        plan = StagePlan.parse(d.stages, t.global_batch_size, t.seq_len) if d.stages else None
        tokenizer = load_data_tokenizer(d, plan)
        data = build_training_data(_DataRun(cfg, tokenizer, plan, torch.device("cpu")), 0, 1)
        data.train.close()  # (only the dataset is read: no loader thread)
        builtin = prepare_builtin(d, tokenizer)[0] if d.path == "builtin" or (plan and "builtin" in plan.sources) \
            else None
    except BaseException:
        if own_group:
            dist.destroy_process_group()
        raise
    from hybridpar.data.dataset import source_names

    names = plan.sources if plan is not None else [p for p in _blend_names(d.path)]
    sources = {n: str(builtin) if n == "builtin" else n for n in names}
    aliases = {short: sources[n] for short, n in zip(source_names(names), names) if short not in sources}
    return Ledger(data.train.dataset, t.global_batch_size, windows, int(state["step"]), sources, tokenizer, aliases,
                  own_group)


@dataclass
class _DataRun:
    """What build_training_data reads of a resolved run."""
    cfg: object
    tokenizer: object
    stages: object
    device: object


def _blend_names(path: str) -> list[str]:
    from hybridpar.data.stages import parse_blend

    return ["builtin"] if path == "builtin" else [p for _, p in parse_blend(path)]
