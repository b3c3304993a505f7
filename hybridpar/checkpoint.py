"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save (sync or async), atomic completion, resume.

Every rank writes its own shards in parallel; the files hold *global* tensors (DTensor shards carry their offsets),
so a checkpoint does not depend on the layout that wrote it and loads into any other (resharding is DCP's load
planner matching global offsets). Parameter names are the plain model's (`layers.0.attn.wq.weight`): the
state-dict helpers strip FSDP, activation-checkpoint and compile wrappers.

Layout of a run directory:
    <run.dir>/checkpoints/step_00000200/
        .metadata, __<rank>_0.distcp     DCP: {"model", "optim", "trainer": {step, consumed_samples, skipped}}
        config.yaml, tokenizer.*        what sampling or resuming needs besides tensors
        run_state.json                  the W&B run id, so a resumed run logs into the same W&B run
        COMPLETE                        written by rank 0 after every rank finished: only then does it count

Only tensors are stored (no pickled Python objects in the state); DCP's .metadata file is a pickle, read here by a
restricted unpickler (SafeReader) that accepts only DCP's own metadata classes. A checkpoint is used only once COMPLETE
exists, so a save cut off at any instant leaves the previous checkpoint the latest one. Older checkpoints are
deleted only after a newer one is complete. RNG: the trainer re-seeds from (seed, step, rank) at every step, so
there is no generator state to carry and a resume draws exactly the random numbers the uninterrupted run drew.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

STEP_PREFIX = "step_"
MARKER = "COMPLETE"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as asked; the message names it and the fix."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata allowing only the plain data classes it is made of: a crafted file cannot run
    code (the tensor files themselves are read with torch.load(weights_only=True) by DCP)."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
               ("pathlib", "PureWindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
               ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}

    def find_class(self, module: str, name: str):
        ok = ((module, name) in self.ALLOWED or module == "torch.distributed.checkpoint.metadata"
              or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)))
        if not ok:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                                         f"metadata: refusing to load it")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read by _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as e:
                raise CheckpointError(f"{path}: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.name.startswith(STEP_PREFIX) and is_complete(p)]
    return sorted(done, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = list_checkpoints(run_dir)
    return done[-1] if done else None


def resolve_load_path(path: str) -> Path:
    """A checkpoint directory, or a run directory (its latest complete checkpoint)."""
    p = Path(path)
    if is_complete(p):
        return p
    latest = latest_checkpoint(p)
    if latest is not None:
        return latest
    if (p / ".metadata").is_file():
        raise CheckpointError(f"checkpoint.load={path!r} was not completed (no {MARKER} marker: the save was cut "
                              f"off); load the previous checkpoint of that run instead")
    raise CheckpointError(f"checkpoint.load={path!r} is neither a complete checkpoint nor a run directory holding "
                          f"one; give <run.dir>/checkpoints/step_XXXXXXXX or <run.dir>")


def _trainer_state(step: int, consumed_samples: int, skipped: int) -> dict[str, torch.Tensor]:
    return {"step": torch.tensor(step), "consumed_samples": torch.tensor(consumed_samples),
            "skipped": torch.tensor(skipped)}


def _state(model: nn.Module, optimizer, trainer_state: dict, options=None) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": model_sd, "optim": optim_sd, "trainer": trainer_state}


class Checkpointer:
    """Saves (sync or async) and loads a trainer's state. Collective: every rank calls save/load/wait."""

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool = False):
        self.run_dir, self.keep_last, self.async_save = Path(run_dir), keep_last, async_save
        self._pending = None  # (future, path, trainer) of an async save in flight
        self.blocking_seconds: list[float] = []  # how long each save stopped the step loop
        # Async saves run their collectives from a background thread: on a gloo group of their own, never the
        # training group (collectives from two threads on one group can interleave differently on each rank); a
        # second one carries the per-step "is the save done everywhere?" vote.
        self._group = self._poll_group = None
        if async_save:
            self._group, self._poll_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")

    def save(self, trainer, step: int) -> Path:
        self.wait()  # one save in flight at a time
        path = checkpoint_dir(self.run_dir, step)
        if dist.get_rank() == 0 and path.exists():  # a save of this step that was cut off earlier
            shutil.rmtree(path)
        dist.barrier()
        state = _state(trainer.model, trainer.optimizer,
                       _trainer_state(step, trainer.consumed_samples, trainer.skipped_steps))
        start = time.perf_counter()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = (future, path, trainer)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._complete(path, trainer)
        self.blocking_seconds.append(time.perf_counter() - start)
        return path

    def _complete(self, path: Path, trainer) -> None:
        """After every rank's shards are written: extras, the marker, then pruning."""
        dist.barrier(group=self._group)
        if dist.get_rank() == 0:
            from hybridpar.config_cli import dump_yaml

            trainer.tokenizer.save(path)
            (path / "config.yaml").write_text(dump_yaml(trainer.cfg))
            wandb_id = trainer.log.wandb_id if trainer.log is not None else None
            (path / "run_state.json").write_text(json.dumps({"wandb_id": wandb_id}) + "\n")
            tmp = path / f".{MARKER}.tmp"
            tmp.write_text(f"step {int(path.name[len(STEP_PREFIX):])}\n")
            tmp.rename(path / MARKER)
            for old in list_checkpoints(self.run_dir)[:-self.keep_last]:
                shutil.rmtree(old)
            # Incomplete saves older than the newest complete one can never be used: clear them too.
            newest = int(path.name[len(STEP_PREFIX):])
            for p in (self.run_dir / "checkpoints").iterdir():
                if p.name.startswith(STEP_PREFIX) and not is_complete(p) and int(p.name[len(STEP_PREFIX):]) < newest:
                    shutil.rmtree(p, ignore_errors=True)
        dist.barrier(group=self._group)

    def poll(self) -> None:
        """Complete an async save once its writes have finished on every rank (called between steps; one small
        gloo all-reduce while a save is in flight, nothing otherwise). The vote keeps all ranks in step."""
        if self._pending is None:
            return
        done = torch.tensor([int(self._pending[0].done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if done.item():
            self.wait()

    def wait(self) -> None:
        if self._pending is not None:
            future, path, trainer = self._pending
            self._pending = None
            future.result()
            self._complete(path, trainer)

    def load(self, trainer, path: Path, weights_only: bool = False) -> None:
        """Restore model (and, unless weights_only, optimizer and trainer position) from checkpoint `path`, into
        whatever layout the trainer has."""
        check_model_config(path, trainer.cfg)
        SafeReader(str(path)).read_metadata()  # a crafted metadata file fails here, as a one-line error
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
        state = {"model": model_sd}
        if not weights_only:
            state["optim"] = optim_sd
            state["trainer"] = _trainer_state(0, 0, 0)
        dcp.load(state, storage_reader=SafeReader(str(path)))
        if weights_only:
            set_model_state_dict(trainer.model, state["model"], options=StateDictOptions(strict=True))
            return
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=True))
        t = state["trainer"]
        trainer.step, trainer.consumed_samples = int(t["step"]), int(t["consumed_samples"])
        trainer.skipped_steps = int(t["skipped"])
        G = trainer.cfg.train.global_batch_size
        if trainer.consumed_samples != trainer.step * G:
            raise CheckpointError(f"checkpoint {path} consumed {trainer.consumed_samples} samples in "
                                  f"{trainer.step} steps, not {trainer.step} x train.global_batch_size={G}: "
                                  f"resume with the global batch size it was saved with")


def check_model_config(path: Path, cfg) -> None:
    """A checkpoint of another architecture fails here, naming the fields that differ."""
    import yaml

    saved_file = Path(path) / "config.yaml"
    if not saved_file.is_file():
        return
    saved = (yaml.safe_load(saved_file.read_text()) or {}).get("model", {})
    from hybridpar.config_cli import to_dict

    now = to_dict(cfg)["model"]
    shape_fields = [k for k in now if k not in ("dropout", "init_std", "name")]
    diff = [f"{k}: checkpoint {saved.get(k)!r} vs now {now[k]!r}" for k in shape_fields
            if k in saved and saved[k] != now[k]]
    if diff:
        raise CheckpointError(f"checkpoint {path} holds a different model ({'; '.join(diff)}); load it with the "
                              f"same model config (its config.yaml) or start a new run")


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint `path` as full plain tensors, read in this one process (no process group)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=SafeReader(str(path)),
                     planner=_EmptyStateDictLoadPlanner(keys={"model"}), no_dist=True)
    return state["model"]


class CheckpointHook:
    """Saves every checkpoint.interval steps and at the end of training (when interval > 0)."""

    def __init__(self, checkpointer: Checkpointer, interval: int):
        self.checkpointer, self.interval = checkpointer, interval
        self.last_saved = -1

    def _save(self, trainer, step: int) -> None:
        path = self.checkpointer.save(trainer, step)
        blocked = self.checkpointer.blocking_seconds[-1]
        trainer.log.print(f"{'started' if self.checkpointer.async_save else 'saved'} checkpoint {path} "
                          f"(step loop blocked {blocked:.2f}s)")
        self.last_saved = step

    def on_step_end(self, trainer, step: int) -> None:
        self.checkpointer.poll()
        if self.interval and step % self.interval == 0:
            self._save(trainer, step)

    def on_train_end(self, trainer) -> None:
        # (A finished run started again resumes at its last step: its final checkpoint exists already.)
        if self.interval and self.last_saved != trainer.step and not is_complete(checkpoint_dir(trainer.run_dir,
                                                                                                  trainer.step)):
            self._save(trainer, trainer.step)
        self.checkpointer.wait()
