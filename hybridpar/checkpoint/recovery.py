"""The loop's state taken back from a checkpoint: after a kill or preemption (resumed_state: the checkpoint's
position with this start's data record and skipped batches) and after a loss spike (train.spike=rewind, the Recovery
part: the host-memory copies of the newest checkpoints, the spike found and not yet acted on, this rank's numbers a
rerun compares, the choice of checkpoint and skipped batches, the replay and its verdict (spike.rerun), the restore
and the removal of the checkpoints after it). The trainer hands it the state, model and optimizer it acts on and a
way to replay steps; it returns the loop's new state.

Every rank takes the same decisions: the spike test reads global values (the loss summed over data-parallel ranks,
the global gradient norm), and a rerun's verdict is gathered from all ranks. The skipped batches and the rewind
count are trainer state (checkpointed), and <run.dir>/skipped_batches.json holds them from the moment of the
rewind, so a run killed before its next checkpoint does not train them again on resume.
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from hybridpar.checkpoint.layout import checkpoint_dir, latest_checkpoint, list_checkpoints, remove_step_dir, step_of
from hybridpar.checkpoint.resume_checks import stage_origin
from hybridpar.config import merge_windows
from hybridpar.data.record import extend
from hybridpar.parallel.distributed import local_tensor
from hybridpar.data.positions import batch_number, windows_text
from hybridpar.training.spikes import find_spike, refuse_skips
from hybridpar.training.step_status import TrainingDiverged
from hybridpar.training.state import TrainState

LOCAL_STATS_STEPS = 10_000  # steps of this rank's own numbers kept for spike.rerun (a rerun compares those it has)


SKIPPED_FILE = "skipped_batches.json"


def read_skipped(run_dir: Path) -> tuple[list[tuple[int, int]], int]:
    """The windows and rewind count <run_dir>/skipped_batches.json records (none when absent). A file that is not
    one (damaged, or not written by a rewind) is a one-line CheckpointError naming it: ignored, the batches it holds
    would be trained again."""
    from hybridpar.errors import CheckpointError

    path = Path(run_dir) / SKIPPED_FILE
    if not path.exists():
        return [], 0
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            raise ValueError("not a small regular file")
        saved = json.loads(path.read_bytes())
        windows = [(int(a), int(b)) for a, b in saved["windows"]]
        if not all(1 <= a <= b for a, b in windows) or type(saved["rewinds"]) is not int or saved["rewinds"] < 0:
            raise ValueError("windows a-b need 1 <= a <= b and a rewind count >= 0")
        return merge_windows(windows), saved["rewinds"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a record of skipped batches ({type(e).__name__}: {str(e)[:80]}); "
                              f"restore it, or delete it to resume with the checkpoint's own skipped batches") \
            from None


def write_skipped(run_dir: Path, windows: list[tuple[int, int]], rewinds: int) -> None:
    tmp = Path(run_dir) / f".{SKIPPED_FILE}.tmp"
    tmp.write_text(json.dumps({"windows": [list(w) for w in windows], "rewinds": rewinds}) + "\n")
    os.replace(tmp, Path(run_dir) / SKIPPED_FILE)


class SpikeLimit(TrainingDiverged):
    """A spike after spike.max_rewinds rewinds: training stops as when it diverges."""


@dataclass(frozen=True)
class Rewind:
    target: int  # the checkpoint's step
    skip: list[tuple[int, int]]  # the batches (1-based windows) of the steps after it that are not trained again
    first: int  # the first step whose batch is skipped


def plan_rewind(cfg, step: int, why: str, rewinds: int, windows: list[tuple[int, int]],
                targets: list[int]) -> Rewind | None:
    """Where the spike of `step` goes back to, given the rewinds done, the skipped windows the steps were picked with
    and the checkpoint steps there are (on disk or in host memory): the newest before the spike.skip steps ending at
    the spike, else the newest before the spike (skipping from there on); None when there is none (training on).
    Raises SpikeLimit past spike.max_rewinds."""
    s = cfg.spike
    if rewinds >= s.max_rewinds:
        so_far = windows_text(windows) or "none"
        raise SpikeLimit(f"loss spike at step {step} ({why}) after {rewinds} rewind(s), spike.max_rewinds="
                         f"{s.max_rewinds}: stopping; the skipped batches so far are {so_far}; look at the data near "
                         f"batch {batch_number(step, windows)}, lower optim.lr, or raise spike.max_rewinds, then "
                         f"resume")
    first = max(1, step - s.skip + 1)
    before = [t for t in targets if t < first]
    if before:
        target = before[-1]
    else:  # only checkpoints inside the window: skip from the newest one on
        inside = [t for t in targets if t < step]
        if not inside:
            return None
        target, first = inside[-1], inside[-1] + 1
    skip = merge_windows((b, b) for b in (batch_number(k, windows) for k in range(first, step + 1)))
    return Rewind(target, skip, first)


def rerun_verdict(everyone: list, first: int, step: int, rotate: bool, dp_size: int, exact: bool) -> str | None:
    """Whether a replay of steps first..step computed what the first pass did, from every rank's (data-parallel rank,
    {step: (first pass, replay)}) with each side this rank's (loss share, gradient-shard norm^2) or None: None when
    they agree (the data made the spike), else which steps and ranks differ (a fault). With `rotate`, the spiking
    step's replay had rank r compute data-parallel rank r+1's batch; `exact` compares bitwise, else to 1e-5."""

    def same(a, b) -> bool:
        return a == b if exact else abs(a - b) <= 1e-5 * max(abs(a), abs(b))

    for k in range(first, step + 1):
        if any(stats[k][0] is None for _, stats in everyone):
            continue
        if rotate and k == step:
            # Rank r computed data-parallel rank r+1's batch: losses compared by batch, exactly (the same weights and
            # tokens); the gradient shards summed the same terms in another order: to 1e-4.
            by_dp = {dp: stats[k][0][0] for dp, stats in everyone}  # (first pass: each rank its own)
            differ = [r for r, (dp, stats) in enumerate(everyone)
                      if not same(stats[k][1][0], by_dp[(dp + 1) % dp_size])
                      or abs(stats[k][1][1] - stats[k][0][1]) > 1e-4 * max(stats[k][1][1], stats[k][0][1])]
            what = "loss of its neighbour's batch or gradient-shard norm"
        else:
            differ = [r for r, (_, stats) in enumerate(everyone) if not all(same(a, b) for a, b in zip(*stats[k]))]
            what = "loss share or gradient-shard norm"
        if differ:
            return f"step {k}: rank(s) {', '.join(map(str, differ))} computed another {what}"
    return None


def _live_tensors(optimizer) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameter shards and optimizer state tensors, named by position, in a fixed order. The
    parameters are the optimizer's: the shards it steps (a module's own may be gathered copies for a while)."""
    out = []
    for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        out.append((f"param{i}", local_tensor(p)))
        for k, v in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(v, torch.Tensor):
                out.append((f"param{i}.{k}", local_tensor(v)))
    return out


class HostCopies:
    """The newest `keep` checkpoints' model and optimizer shards (this rank's) and trainer state in host memory,
    taken when the checkpoint is saved. restore() copies one back bitwise: the same values a read of the checkpoint
    from disk gives, without the read."""

    def __init__(self, keep: int):
        self.keep = keep
        self.copies: OrderedDict[int, tuple[dict, dict]] = OrderedDict()

    def take(self, step: int, optimizer, position: dict) -> None:
        """Copy this rank's shards (the optimizer's parameters and state) and the loop's `position` of checkpoint
        `step`."""
        if not self.keep:
            return
        self.copies[step] = ({name: t.detach().to("cpu", copy=True) for name, t in _live_tensors(optimizer)}, position)
        while len(self.copies) > self.keep:
            self.copies.popitem(last=False)

    def steps(self) -> list[int]:
        return list(self.copies)

    def drop_after(self, step: int) -> None:
        for s in [s for s in self.copies if s > step]:
            del self.copies[s]

    def restore(self, step: int, optimizer) -> dict:
        """Copy checkpoint `step`'s shards back into the optimizer's parameters and state; returns its position."""
        tensors, position = self.copies[step]
        if not any("." in name for name in tensors):  # taken before the first optimizer step: a fresh optimizer
            optimizer.state.clear()
        live = _live_tensors(optimizer)
        if [n for n, _ in live] != list(tensors):
            raise RuntimeError(f"host copy of step {step}: the optimizer state's layout changed since it was taken")
        with torch.no_grad():
            for name, t in live:
                t.copy_(tensors[name])
        return position


class Recovery:
    """The loop's recovery part for one process. say/log: the trainer's console line and metrics row."""

    def __init__(self, cfg, run_dir: Path, checkpointer, keep_in_memory: int, dp_rank: int, dp_size: int,
                 bitwise: bool, say: Callable[[str], None], log: Callable[[dict], None]):
        self.cfg, self.run_dir, self.checkpointer = cfg, Path(run_dir), checkpointer
        self.copies = HostCopies(keep_in_memory)
        self.dp_rank, self.dp_size, self.bitwise, self.say, self.log = dp_rank, dp_size, bitwise, say, log
        self.spike: tuple[int, str] | None = None  # (step, why) of a spike found, acted on at the step's end
        self.local_stats: dict[int, tuple[float, float]] = {}  # step -> this rank's (loss share, grad shard norm^2)
        self.replaying = False  # steps are being replayed (nothing tested then)
        self.rank = dist.get_rank()

    def local_numbers(self, loss: torch.Tensor, model) -> torch.Tensor | None:
        """With spike.rerun, this rank's own (loss share, squared norm of its gradient shards) of the step just
        computed, on the device (note_local keeps them once its status is read), for a rerun to compare with."""
        if self.cfg.spike.rerun == "off":
            return None
        shard_sq = sum((local_tensor(p.grad).float() ** 2).sum() for p in model.parameters() if p.grad is not None)
        return torch.stack([loss.detach().float().reshape(()), shard_sq])

    def note_local(self, step: int, local) -> None:
        if local is not None:
            self.local_stats[step] = local
            self.local_stats.pop(step - LOCAL_STATS_STEPS, None)

    def test(self, step: int, loss: float, norm: float, history: list) -> list:
        """The spike test of a finite step (train.spike warn or rewind) against the window `history`; returns the
        window after it. A spike is reported (and, with rewind, acted on at the end of the step) and kept out of the
        window; other steps enter it."""
        why = None if self.replaying or self.spike is not None else find_spike(self.cfg.spike, history, loss, norm)
        if why is None:
            if self.spike is None or self.replaying:
                return (history + [(loss, norm)])[-self.cfg.spike.window:]
            return history
        rewind = self.cfg.train.spike == "rewind"
        self.say(f"warning: step {step}: loss spike: {why}" + ("" if rewind else " (train.spike=warn: training on)"))
        self.log({"step": step, "spike": why, "spike_loss": loss, "spike_grad_norm": norm})
        if rewind:  # (kept out of the window until the step's end acts on it)
            self.spike = (step, why)
        return history

    def save_refused(self, state: TrainState, step: int) -> str | None:
        """Why checkpoint `step` is not saved, or None: never inside a non-finite streak (a resume would hide it), nor
        with a spike about to be rewound."""
        if state.skip_streak:
            latest = latest_checkpoint(self.run_dir)
            return (f"warning: not saving a checkpoint at step {step}: {state.skip_streak} non-finite step(s) in a "
                    f"row; the latest checkpoint {latest if latest is not None else '(none)'} predates the streak")
        if self.spike is not None:
            return f"not saving a checkpoint at step {step}: the loss spike of step {self.spike[0]} is being rewound"
        return None

    def took(self, step: int, optimizer, position: dict) -> None:
        """Checkpoint `step` was saved with `position`: its host copy."""
        self.copies.take(step, optimizer, position)

    def act(self, state: TrainState, model, optimizer, position: Callable[[TrainState], dict],
            write: Callable[[int, TrainState], None],
            replay: Callable[[TrainState, int, bool], TrainState]) -> TrainState | None:
        """Act on the spike found (collective): the loop's state after it, None without a checkpointer (the warning
        was all). position(state): its checkpoint entries; write(step, state): save the model and optimizer as
        checkpoint `step`; replay(state, step, rotate): the state after training to `step` again. With spike.rerun,
        a replay that differs shows a fault: training goes on from the spike, nothing skipped."""
        (step, why), self.spike = self.spike, None
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()  # an async save in flight completes before checkpoints are chosen or removed
        cfg, start = self.cfg.spike, time.perf_counter()
        targets = sorted({step_of(p) for p in list_checkpoints(self.run_dir)} | set(self.copies.steps()))
        windows = list(state.skip_windows)  # the batches of the steps up to the spike were picked with these
        plan = plan_rewind(self.cfg, step, why, state.rewinds, windows, targets)
        if plan is None:
            self.say(f"warning: no checkpoint before step {step} to rewind to; training on")
            return state
        target = plan.target
        if cfg.rerun != "off":
            original = {k: self.local_stats.get(k) for k in range(target + 1, step + 1)}
            rotate = cfg.rerun == "rotate" and self.dp_size > 1
            self.replaying = True
            try:
                state = replay(self._restore(state, target, model, optimizer, position), step, rotate)
            finally:
                self.replaying = False
            mine = {k: (original[k], self.local_stats.get(k)) for k in original}
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, (self.dp_rank, mine))
            fault = rerun_verdict(everyone, target + 1, step, rotate, self.dp_size, self.bitwise)
            if fault is not None:  # the replayed steps are sound: go on from the spiking step, nothing skipped
                state.rewinds += 1
                self.log({"step": step, "fault": fault, "rerun_from": target, "reason": why,
                          "rewind_seconds": time.perf_counter() - start})
                self.say(f"step {step}: rerun from step {target} differs: a fault, not the data ({fault}); training "
                         f"on from step {step} without skipping ({state.rewinds} of {cfg.max_rewinds} rewinds)")
                self._forget_after(target)
                return state
        rewinds = state.rewinds + 1
        source = "host memory" if target in self.copies.steps() else "disk"
        s = self._restore(state, target, model, optimizer, position)
        s.skip_windows, s.rewinds = merge_windows(windows + plan.skip), rewinds
        if cfg.lr_steps:
            s.lr_scale_until = max(s.lr_scale_until, target + cfg.lr_steps)
        self._forget_after(target)
        if self.rank == 0:
            write_skipped(self.run_dir, s.skip_windows, s.rewinds)
        if target not in [step_of(p) for p in list_checkpoints(self.run_dir)]:  # only in host memory: save it
            write(target, s)
        seconds = time.perf_counter() - start
        samples = sum(b - a + 1 for a, b in plan.skip) * self.cfg.train.global_batch_size
        self.log({"step": step, "rewind": rewinds, "rewind_to": target, "skipped_batches": windows_text(plan.skip),
                  "samples_skipped": samples, "reason": why, "rewind_source": source, "rewind_seconds": seconds})
        self.say(f"rewind {rewinds}/{cfg.max_rewinds}: back to step {target} ({source}, {seconds:.2f}s), batches "
                 f"{windows_text(plan.skip)} ({samples:,} samples) skipped"
                 + (f", learning rate x {cfg.lr_scale} until step {s.lr_scale_until}" if cfg.lr_steps else ""))
        return s

    def _restore(self, state: TrainState, step: int, model, optimizer, position) -> TrainState:
        """Model, optimizer and position of checkpoint `step` (host memory when a copy is there, else disk)."""
        # The steps after it are trained again: what this rank recorded of them belongs to the pass abandoned.
        self.local_stats = {k: v for k, v in self.local_stats.items() if k <= step}
        if step in self.copies.steps():
            restored = TrainState.of(self.copies.restore(step, optimizer))
        else:
            saved, _ = self.checkpointer.load(checkpoint_dir(self.run_dir, step), model, optimizer, position(state))
            restored = TrainState.of(saved)
        restored.data_segments = restored.rewound_segments(state.data_segments)
        return restored

    def _forget_after(self, target: int) -> None:
        """Checkpoints after `target` hold steps that are being trained again: removed (a resume must not find one)."""
        self.copies.drop_after(target)
        if self.rank == 0:
            for p in list_checkpoints(self.run_dir):
                if step_of(p) > target:
                    remove_step_dir(p)
        dist.barrier()


def check_recorded_skips(cfg, state: TrainState, recorded: list[tuple[int, int]], run_dir: Path) -> None:
    """The windows the run dir's skipped_batches.json holds lie where this run's rewinds can reach: at most
    spike.max_rewinds x spike.skip batches past the last step's batch (a rewind skips batches of steps it ran)."""
    from hybridpar.errors import CheckpointError

    s, where = cfg.spike, Path(run_dir) / SKIPPED_FILE
    reach = state.batch_for(cfg.train.steps - 1) + 1 + s.max_rewinds * s.skip
    far = [w for w in recorded if w[1] > reach]
    if far:
        raise CheckpointError(f"{where} records skipped batches {windows_text(far)}, past batch {reach:,}, the "
                              f"last this run's rewinds can reach: the file is damaged; delete it to resume with "
                              f"the checkpoint's own skipped batches")
    # A rewind records batches after the checkpoint it goes back to; those the checkpoint trained past are in its
    # own windows (it was saved after that rewind), or the file belongs to another history.
    trained = state.batch_for(state.step - 1) + 1 if state.step else 0  # the last batch trained, 1-based
    held = [(a, min(b, trained)) for a, b in recorded if a <= trained]
    other = [w for w in held if not any(c <= w[0] and w[1] <= d for c, d in state.skip_windows)]
    if other:
        raise CheckpointError(f"{where} records skipped batches {windows_text(other)}, which the checkpoint (step "
                              f"{state.step}, batch {trained}) trained: the file belongs to another history; "
                              f"delete it to resume with the checkpoint's own skipped batches")


def resumed_state(cfg, path: Path, saved: dict, start: dict, stages, n_batches: int, run_dir: Path,
                  skipped: tuple[list, int]):
    """The loop's state resumed from checkpoint `path`'s saved position, and, for a staged run, where its sampler
    restarts (stage_origin; None: where it stands). The data record is extended by this start's segment `start`
    (refused when a source changed, unless checkpoint.allow_data_change); the skipped batches are the union of the
    checkpoint's, data.skip_batches and `skipped` (the windows and rewind count the run dir recorded since that
    checkpoint), each checked against the position."""
    state = TrainState.of(saved)
    state.data_segments = extend(state.data_segments, {**start, "from_step": state.step},
                                 cfg.checkpoint.allow_data_change, path)
    windows = list(state.skip_windows)
    state.skip_windows = merge_windows(windows + list(cfg.data.skip_windows))
    refuse_skips(cfg, state.step, windows, state.skip_windows, n_batches)
    origin = None
    if stages is not None:  # each source continues where it was, also after a change of stages
        origin = stage_origin(path, cfg, stages, saved.get("stage_origin"), state.batch_for(state.step))
        if origin is not None:
            state.data_segments[-1] = {**state.data_segments[-1],  # (provenance rebuilds the sampler from it)
                                       "stage_origin": [int(origin[0]), *map(int, origin[1])]}
    check_recorded_skips(cfg, state, skipped[0], run_dir)
    state.skip_windows = merge_windows(state.skip_windows + list(skipped[0]))
    state.rewinds = max(state.rewinds, skipped[1])
    return state, origin
