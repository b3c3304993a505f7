"""Sharded checkpoints with torch.distributed.checkpoint (DCP).

Every rank writes its own shards in parallel; the files hold *global* tensors (DTensor shards carry their offsets),
so a checkpoint does not depend on the layout that wrote it. Parameter names are the plain model's
(`layers.0.attn.wq.weight`): the state-dict helpers strip FSDP, activation-checkpoint and compile wrappers.

Layout of a run directory:
    <run.dir>/checkpoints/step_00000200/   DCP files (.metadata, __<rank>_0.distcp)
                                           {"model": ..., "optim": ..., "step": int},
                                           plus the tokenizer and config.yaml

`load_full_model_state(path)` reads the model weights of a checkpoint into one process as plain tensors, without
a process group (for export, evaluation, and layout comparisons).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

STEP_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (a directory without .metadata was not finished)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and (p / ".metadata").exists()]
    return sorted(done, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def save_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Collective: every rank of the world calls it. Writes model, optimizer state and the step to `path`."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=str(path))


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    """Rank 0 removes all but the newest keep_last complete checkpoints (call after every rank finished saving)."""
    if dist.get_rank() != 0:
        return
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old)


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint `path` as full plain tensors, read in this one process."""
    # The reader dcp_to_torch_save uses, limited to the model's keys.
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=dcp.FileSystemReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return state["model"]


class CheckpointHook:
    """Saves every checkpoint.interval steps and at the end of training (when interval > 0), keeping the newest
    checkpoint.keep_last."""

    def __init__(self, interval: int, keep_last: int):
        self.interval, self.keep_last = interval, keep_last
        self.last_saved = -1

    def _save(self, trainer, step: int) -> None:
        path = checkpoint_dir(trainer.run_dir, step)
        save_checkpoint(path, trainer.model, trainer.optimizer, step)
        if dist.get_rank() == 0:  # what sampling from the checkpoint later needs besides the weights
            from hybridpar.config_cli import dump_yaml

            trainer.tokenizer.save(path)
            (path / "config.yaml").write_text(dump_yaml(trainer.cfg))
        dist.barrier()
        prune_checkpoints(trainer.run_dir, self.keep_last)
        trainer.log.print(f"saved checkpoint {path}")
        self.last_saved = step

    def on_step_end(self, trainer, step: int) -> None:
        if self.interval and step % self.interval == 0:
            self._save(trainer, step)

    def on_train_end(self, trainer) -> None:
        if self.interval and self.last_saved != trainer.step:
            self._save(trainer, trainer.step)
