"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save (sync or async), atomic completion, resume.

Every rank writes its own shards in parallel; the files hold *global* tensors (DTensor shards carry their offsets),
so a checkpoint does not depend on the layout that wrote it and loads into any other (resharding is DCP's load
planner matching global offsets). Parameter names are the plain model's (`layers.0.attn.wq.weight`): the
state-dict helpers strip FSDP, activation-checkpoint and compile wrappers.

Layout of a run directory:
    <run.dir>/checkpoints/step_00000200/
        .metadata, __<rank>_0.distcp     DCP: {"model", "optim", "trainer": the loop's position (TrainState:
                                        step, consumed_samples, skipped, skip_streak, the skipped batches, the
                                        spike test's window, rewinds, lr_scale_until, exact_bounds
                                        (parallel.exact_reduction's grids; empty outside it); a staged
                                        run's stage_origin) and data_key, the data settings' CRC-32
                                        (resume_checks.data_key)}
        config.yaml, tokenizer.*        what sampling or resuming needs besides tensors
        run_state.json                  the W&B run id (a resumed run logs into the same W&B run), the
                                        tokenizer's fingerprint (a resume with other data is refused) and a CPU
                                        run's intra-op thread count (cpu_threads: a bitwise resume needs it)
        COMPLETE                        written by rank 0 after every rank finished: only then does it count

Only tensors and the optimizer's plain hyper-parameters are stored; nothing read back can run code (see
hybridpar/checkpoint/safe_load.py: an explicit allow-list for DCP's .metadata pickle, weights-only unpickling for
byte entries, shard names and lengths checked before any read). A checkpoint is used only once COMPLETE exists,
so a save cut off at any instant leaves the previous checkpoint the latest one. Older checkpoints are deleted only
after a newer one is complete. RNG: the trainer re-seeds from (seed, step) at every step, so
there is no generator state to carry and a resume draws exactly the random numbers the uninterrupted run drew.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from hybridpar.checkpoint.layout import (MARKER, STEP_DIR, checkpoint_dir, is_complete, latest_checkpoint,
                                         list_checkpoints, remove_step_dir, step_of)
from hybridpar.checkpoint.resume_checks import check_model_config, data_changes, data_key
from hybridpar.checkpoint.safe_load import (CheckpointError, SafeEmptyLoadPlanner, SafeLoadPlanner, SafeReader,
                                            exceptions_in, plain_tensors, read_metadata,
                                            unwrap_checkpoint_exception)
from hybridpar.parallel.distributed import local_tensor

def _local_bytes(state) -> int:
    """Bytes of the tensors this rank writes for `state` (its own shards)."""
    total = 0
    for v in state.values():
        if isinstance(v, dict):
            total += _local_bytes(v)
        elif isinstance(v, torch.Tensor):
            local = local_tensor(v)
            total += local.numel() * local.element_size()
    return total


def _safe_load(state: dict, path: Path, planner, metadata=None, no_dist: bool = False) -> None:
    """DCP load of `state` from checkpoint `path` through the safe reader and planner (checkpoint/safe_load.py),
    the metadata read and checked once; our CheckpointErrors come out as themselves, not wrapped per rank by DCP."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = SafeReader(str(path), metadata if metadata is not None else read_metadata(path))
    try:
        if no_dist:  # into a state dict the planner fills (an empty one for _EmptyStateDictLoadPlanner)
            _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)
        else:
            dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as e:
        inner = unwrap_checkpoint_exception(e)
        if inner is e:
            raise
        raise (inner if str(path) in str(inner) else CheckpointError(f"checkpoint {path}: {inner}")) from None


def _state(model: nn.Module, optimizer, trainer_state: dict, options=None) -> dict:
    """What a checkpoint holds. Before the first optimizer step (a seed checkpoint) AdamW has no state: none is
    saved (asking for it would allocate two zero copies of every shard), and a load starts a fresh optimizer."""
    if not optimizer.state:
        return {"model": plain_tensors(get_model_state_dict(model, options=options)), "trainer": trainer_state}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": plain_tensors(model_sd), "optim": plain_tensors(optim_sd), "trainer": trainer_state}


class Checkpointer:
    """Saves (sync or async) and loads the states it is given: the model, its optimizer and the training loop's
    position (a dict of ints and tensors). It holds what every save writes besides them (the run's config and
    tokenizer) and never reads the trainer. Collective: every rank calls save/load/wait."""

    def __init__(self, run_dir: Path, cfg, tokenizer, device: torch.device):
        self.run_dir, self.cfg, self.tokenizer, self.device = Path(run_dir), cfg, tokenizer, device
        self.keep_last, self.async_save = cfg.checkpoint.keep_last, cfg.checkpoint.async_save
        self._pending = None  # (future, path, wandb id) of an async save in flight
        self._need_bytes = 0  # what this rank writes for the save under way
        # Async saves run their collectives from a background thread: on a gloo group of their own, never the
        # training group (collectives from two threads on one group can interleave differently on each rank); a
        # second one carries the per-step "is the save done everywhere?" vote.
        self._group = self._poll_group = None
        if self.async_save:
            self._group, self._poll_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")

    def due(self, step: int, last_saved: int, end: bool = False) -> bool:
        """Whether step `step` is saved (`last_saved`: the newest this process saved): every checkpoint.interval
        steps, and at the end of a run unless it is saved already (a finished run started again resumes at its last
        step, whose checkpoint exists)."""
        interval = self.cfg.checkpoint.interval
        if not interval:
            return False
        if not end:
            return step % interval == 0
        return last_saved != step and not is_complete(checkpoint_dir(self.run_dir, step))

    def save(self, step: int, model: nn.Module, optimizer, position: dict, wandb_id: str | None = None) -> Path:
        """Checkpoint `step`: the model's and optimizer's shards and the loop's `position`; wandb_id is the run's
        W&B id (a resume logs into the same W&B run)."""
        self.wait()  # one save in flight at a time
        path = checkpoint_dir(self.run_dir, step)
        if dist.get_rank() == 0:  # a save of this step that was cut off earlier (or a link in its place)
            remove_step_dir(path)
        dist.barrier()
        position = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in
                    {**position, "step": step, "data_key": data_key(self.cfg)}.items()}
        state = _state(model, optimizer, position)
        self._need_bytes = _local_bytes(state)
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            self._pending = (future, path, wandb_id)
        else:
            try:
                dcp.save(state, checkpoint_id=str(path))
            except (Exception, CheckpointException) as e:  # every rank gets DCP's gathered exception
                raise self._save_failed(path, e) from None
            self._complete(path, wandb_id)
        return path

    def _save_failed(self, path: Path, e: BaseException) -> BaseException:
        """A full disk (or quota, or permissions) during a save is the user's to fix: one line naming the directory,
        the partial save removed, the previous checkpoint still the latest. Other errors stay as they are.
        torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos"), without errno: a failed
        save that leaves less free space than this rank had to write counts as a full disk too."""
        os_error = next((x for x in exceptions_in(e) if isinstance(x, OSError)
                         and x.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS)), None)
        try:
            full = shutil.disk_usage(path.parent).free < self._need_bytes
        except OSError:
            full = False
        if os_error is None and not full:
            return e
        if dist.get_rank() == 0:
            try:
                remove_step_dir(path)
            except OSError:
                pass
        latest = latest_checkpoint(self.run_dir)
        reason = ("no space left" if os_error is None or os_error.errno in (errno.ENOSPC, errno.EDQUOT)
                  else os.strerror(os_error.errno))
        return CheckpointError(f"{reason} on {path.parent} while saving checkpoint {path.name}; the latest complete "
                               f"checkpoint is {latest if latest is not None else '(none)'}: free space (or fix the "
                               f"directory), then start the same command again to resume")

    def _complete(self, path: Path, wandb_id: str | None) -> None:
        """After every rank's shards are written: extras, the marker, then pruning."""
        dist.barrier(group=self._group)
        error = None
        try:
            if dist.get_rank() == 0:
                self._write_extras_and_prune(path, wandb_id)
        except OSError as e:
            error = e
        # Every rank learns whether rank 0's writes failed (on the save group's device: CPU for gloo).
        failed = torch.tensor([int(error is not None)], device="cpu" if self._group is not None else self.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self._group)
        if error is not None:
            raise self._save_failed(path, error)
        if failed.item():
            raise CheckpointError(f"saving checkpoint {path} failed on rank 0 (its error says why)")

    def _write_extras_and_prune(self, path: Path, wandb_id: str | None) -> None:
        from hybridpar.config.cli import dump_yaml

        self.tokenizer.save(path)
        (path / "config.yaml").write_text(dump_yaml(self.cfg))
        # cpu_threads: a CPU run's intra-op thread count, which sets the order of its parallel reductions (a
        # resume with another count continues the curve to rounding, not bitwise; pretrain_gpt.py says so).
        cpu_threads = torch.get_num_threads() if self.device.type == "cpu" else None
        (path / "run_state.json").write_text(json.dumps(
            {"wandb_id": wandb_id, "tokenizer_fingerprint": self.tokenizer.fingerprint,
             "cpu_threads": cpu_threads}) + "\n")
        tmp = path / f".{MARKER}.tmp"
        tmp.write_text(f"step {step_of(path)}\n")
        tmp.rename(path / MARKER)
        for old in list_checkpoints(self.run_dir)[:-self.keep_last]:
            remove_step_dir(old)
        # Incomplete saves older than the newest complete one can never be used: clear them too.
        newest = step_of(path)
        for p in (self.run_dir / "checkpoints").iterdir():
            if STEP_DIR.fullmatch(p.name) and not is_complete(p) and step_of(p) < newest:
                remove_step_dir(p)

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
            future, path, wandb_id = self._pending
            self._pending = None
            try:
                future.result()
            except (Exception, CheckpointException) as e:
                raise self._save_failed(path, e) from None
            self._complete(path, wandb_id)

    def load(self, path: Path, model: nn.Module, optimizer, position_keys, weights_only: bool = False
             ) -> tuple[dict | None, list[str]]:
        """Restore the model (and, unless weights_only, the optimizer) from checkpoint `path`, into whatever layout
        they have. Returns the loop's saved position, the entries named in `position_keys` that the checkpoint
        has (ints, and tensors for the windows and histories; None with weights_only) and the data settings that changed (allowed by checkpoint.allow_data_change); raises
        CheckpointError (nothing loaded) if they changed without it."""
        cfg = self.cfg
        check_model_config(path, cfg)
        changes = [] if weights_only else data_changes(path, cfg, self.tokenizer.fingerprint)
        metadata = read_metadata(path)  # read once; a crafted or damaged checkpoint fails here, as a one-line error
        saved_key = None if weights_only else read_trainer_state(path, True, metadata).get("data_key")  # older: none
        if not changes and saved_key is not None and saved_key != data_key(cfg):
            changes = ["one of train.seed, train.seq_len, data.path, data.split, data.tokenizer, data.stages (the "
                       "checkpoint has no config.yaml to name which)"]
        if changes and not cfg.checkpoint.allow_data_change:
            raise CheckpointError(f"resuming from {path} with other data settings ({'; '.join(changes)}): the "
                                  f"saved data position would index other samples; restore them, start a new "
                                  f"run with --run.name NAME, or pass --checkpoint.allow_data_change true")
        saved = metadata.state_dict_metadata
        _check_shapes(path, saved, get_model_state_dict(model))
        with_optim = not weights_only and any(k.startswith("optim.") for k in saved)  # a seed checkpoint has none
        if with_optim:
            was = "muon" if any(k.endswith(".momentum_buffer") for k in saved) else "adamw"
            if was != cfg.optim.name:
                raise CheckpointError(f"{path} holds {was} optimizer state and this run has optim.name="
                                      f"{cfg.optim.name}; resume with --optim.name {was}, or start from its "
                                      f"weights with --checkpoint.load_weights_only true")
            model_sd, optim_sd = map(plain_tensors, get_state_dict(model, optimizer))
            # Only the optimizer's tensors are read: its hyperparameters are this run's choice (its config, the
            # device), and reading the saved ones (a pickled value per parameter and setting) was most of a small
            # model's resume time.
            groups = optim_sd["param_groups"]
            optional = getattr(optimizer, "optional_state", ())  # what the optimizer starts afresh when not saved
            for fqn, entry in optim_sd["state"].items():
                for key in [k for k in optional if k in entry and f"optim.state.{fqn}.{k}" not in saved]:
                    del entry[key]
            state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
        else:
            state = {"model": plain_tensors(get_model_state_dict(model))}
        if not weights_only:  # the position's keys (older checkpoints lack some fields; no others are read)
            state["trainer"] = {k: _placeholder(saved[f"trainer.{k}"]) for k in [*position_keys, "data_key"]
                                if f"trainer.{k}" in saved}
        _safe_load(state, path, SafeLoadPlanner(), metadata)
        if not with_optim:
            set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))
        else:
            # Hyperparameters and the kernel are this run's choice, not the saved run's: a CPU run's checkpoint
            # resumed on a GPU, or with another optim.fused, keeps the kernel it was built with.
            chosen = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict={"state": state["optim"]["state"], "param_groups": groups},
                           options=StateDictOptions(strict=True))
            for group, settings in zip(optimizer.param_groups, chosen):
                group.update(settings)
        if weights_only:
            return None, []
        t = {k: v if v.dim() else int(v) for k, v in state["trainer"].items() if k != "data_key"}
        step, consumed, G = t["step"], t["consumed_samples"], cfg.train.global_batch_size
        if not with_optim and step:
            raise CheckpointError(f"checkpoint {path} is at step {step} but holds no optimizer state; load it "
                                  f"with --checkpoint.load_weights_only true")
        if consumed != step * G:
            raise CheckpointError(f"checkpoint {path} consumed {consumed} samples in {step} steps, not {step} x "
                                  f"train.global_batch_size={G}: resume with the global batch size it was saved with")
        return t, changes


def _placeholder(entry) -> torch.Tensor:
    """A tensor of a saved entry's shape and dtype, for DCP to load into."""
    size = tuple(getattr(entry, "size", ()) or ())
    dtype = getattr(getattr(entry, "properties", None), "dtype", None) or torch.int64
    return torch.zeros(size, dtype=dtype)


def _check_shapes(path: Path, saved: dict, model_state: dict) -> None:
    """Every model tensor the run needs is in the checkpoint with its global shape: read from the DCP metadata, so
    it holds without the checkpoint's config.yaml."""
    for name, t in model_state.items():
        entry = saved.get(f"model.{name}")
        size = tuple(getattr(entry, "size", ()) or ())
        if entry is None or size != tuple(t.shape):
            found = "is missing" if entry is None else f"has shape {list(size)}"
            raise CheckpointError(f"checkpoint {path} holds a different model: model.{name} {found}, this run's is "
                                  f"{list(t.shape)}; load it with the model config it was saved with")


def check_config_matches_tensors(path: Path, model_cfg) -> None:
    """The model a checkpoint's config.yaml describes is the model its tensors hold, name for name and shape for
    shape (an export trusting an edited config.yaml wrote a folder transformers refuses, or dropped blocks)."""
    from hybridpar.models import build_model

    want = build_model(model_cfg, "meta", init=False).state_dict()
    saved = read_metadata(path).state_dict_metadata
    _check_shapes(path, saved, want)
    extra = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k[len("model."):] not in want)
    if extra:
        more = f" (and {len(extra) - 1} more tensors)" if len(extra) > 1 else ""
        raise CheckpointError(f"checkpoint {path} holds {extra[0]}{more} that its config.yaml's model lacks: the "
                              f"config and the tensors disagree; restore the run's config.yaml")


def load_full_model_state(path: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The model weights of checkpoint `path` (or only those in `names`) as full plain tensors, read in this one
    process (no process group)."""
    state: dict = {}
    keys = {f"model.{n}" for n in names} if names else {"model"}
    _safe_load(state, path, SafeEmptyLoadPlanner(keys=keys), no_dist=True)
    return state["model"]


def load_model_weights(model: nn.Module, path: Path) -> None:
    """Only the model weights of checkpoint `path` into `model` of any layout (each rank reads its shards)."""
    metadata = read_metadata(path)
    state = {"model": get_model_state_dict(model)}
    _check_shapes(path, metadata.state_dict_metadata, state["model"])
    _safe_load(state, path, SafeLoadPlanner(), metadata)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=True))


def read_trainer_state(path: Path, with_data_key: bool = False, metadata=None) -> dict:
    """The trainer position saved in checkpoint `path`: step, consumed_samples, skipped, skip_streak, rewinds,
    lr_scale_until as ints, skip_windows, spike_history and exact_bounds as lists (the older fields only, in older
    checkpoints);
    with with_data_key also the data settings' key (resume_checks.data_key) where the checkpoint has one."""
    state: dict = {}
    _safe_load(state, path, SafeEmptyLoadPlanner(keys={"trainer"}), metadata, no_dist=True)
    return {k: v.tolist() if v.dim() else int(v) for k, v in state["trainer"].items()
            if with_data_key or k != "data_key"}
