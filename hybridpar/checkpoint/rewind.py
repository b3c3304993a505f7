"""train.spike=rewind: on a loss spike, go back to the newest checkpoint before the spike's batches (from host memory
when a copy is there, else from disk), skip those batches, and continue; with spike.rerun, first replay up to the
spiking step and tell the data from a fault.

Every rank takes the same decisions: the spike test reads global values (the loss summed over data-parallel ranks,
the global gradient norm), and a rerun's verdict is gathered from all ranks. The skipped batches and the rewind
count are trainer state (checkpointed), and <run.dir>/skipped_batches.json holds them from the moment of the
rewind, so a run killed before its next checkpoint does not train them again on resume.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from hybridpar.checkpoint.layout import checkpoint_dir, list_checkpoints, step_of
from hybridpar.config import merge_windows
from hybridpar.training.spikes import HostCopies, batch_number, windows_text

SKIPPED_FILE = "skipped_batches.json"


def read_skipped(run_dir: Path) -> tuple[list[tuple[int, int]], int]:
    """The windows and rewind count <run_dir>/skipped_batches.json records (none when absent or unreadable)."""
    try:
        saved = json.loads((Path(run_dir) / SKIPPED_FILE).read_text())
        windows = [(int(a), int(b)) for a, b in saved["windows"]]
        if not all(1 <= a <= b for a, b in windows):
            raise ValueError(windows)
        return merge_windows(windows), int(saved["rewinds"])
    except (OSError, ValueError, KeyError, TypeError):
        return [], 0


def write_skipped(run_dir: Path, windows: list[tuple[int, int]], rewinds: int) -> None:
    tmp = Path(run_dir) / f".{SKIPPED_FILE}.tmp"
    tmp.write_text(json.dumps({"windows": [list(w) for w in windows], "rewinds": rewinds}) + "\n")
    os.replace(tmp, Path(run_dir) / SKIPPED_FILE)


class SpikeLimit(RuntimeError):
    """A spike after spike.max_rewinds rewinds."""


class Rewinder:
    """Acts on the spike a trainer found (Trainer.spike), at the end of a step. Collective: every rank calls it."""

    def __init__(self, checkpointer, copies: HostCopies):
        self.checkpointer, self.copies = checkpointer, copies

    # -- where to go back to -----------------------------------------------------------------------------------
    def _targets(self, trainer) -> list[int]:
        on_disk = [step_of(p) for p in list_checkpoints(trainer.run_dir)]
        return sorted(set(on_disk) | set(self.copies.steps()))

    def _restore(self, trainer, step: int) -> str:
        """Model, optimizer and trainer state of checkpoint `step`; returns where they came from."""
        # The steps after it are trained again: what this rank recorded of them belongs to the pass abandoned.
        trainer.local_stats = {k: v for k, v in trainer.local_stats.items() if k <= step}
        if step in self.copies.copies:
            self.copies.restore(trainer, step)
            return "host memory"
        self.checkpointer.load(trainer, checkpoint_dir(trainer.run_dir, step))
        return "disk"

    def rewind(self, trainer) -> None:
        trainer.settle()
        self.checkpointer.wait()  # an async save in flight completes before checkpoints are chosen or removed
        step, why = trainer.spike
        trainer.spike = None
        cfg = trainer.cfg.spike
        if trainer.rewinds >= cfg.max_rewinds:
            raise SpikeLimit(f"loss spike at step {step} ({why}) after {trainer.rewinds} rewind(s), "
                             f"spike.max_rewinds={cfg.max_rewinds}: stopping; the skipped batches so far are "
                             f"{windows_text(trainer.skip_windows) or 'none'}; look at the data near batch "
                             f"{batch_number(step, trainer.skip_windows)}, lower optim.lr, or raise spike.max_rewinds, "
                             f"then resume")
        first = max(1, step - cfg.skip + 1)
        targets = self._targets(trainer)
        before = [s for s in targets if s < first]
        if before:
            target = before[-1]
        else:  # only checkpoints inside the window: skip from the newest one on
            inside = [s for s in targets if s < step]
            if not inside:
                trainer.say(f"warning: no checkpoint before step {step} to rewind to; training on")
                return
            target, first = inside[-1], inside[-1] + 1
        start = time.perf_counter()
        windows = list(trainer.skip_windows)  # the batches of steps first..step were picked with these
        skip = merge_windows((b, b) for b in (batch_number(k, windows) for k in range(first, step + 1)))
        if cfg.rerun != "off":
            fault = self._rerun(trainer, target, step)
            if fault is not None:  # the replayed steps are sound: go on from the spiking step, nothing skipped
                trainer.rewinds += 1
                self._log(trainer, step, {"fault": fault, "rerun_from": target, "reason": why,
                                          "rewind_seconds": time.perf_counter() - start})
                trainer.say(f"step {step}: rerun from step {target} differs: a fault, not the data ({fault}); "
                            f"training on from step {step} without skipping ({trainer.rewinds} of "
                            f"{cfg.max_rewinds} rewinds)")
                self._forget_after(trainer, target)
                return
        rewinds = trainer.rewinds + 1
        source = self._restore(trainer, target)
        trainer.skip_windows = merge_windows(windows + skip)
        trainer.rewinds = rewinds
        if cfg.lr_steps:
            trainer.lr_scale_until = max(trainer.lr_scale_until, target + cfg.lr_steps)
        self._forget_after(trainer, target)
        if dist.get_rank() == 0:
            write_skipped(trainer.run_dir, trainer.skip_windows, trainer.rewinds)
        if target not in [step_of(p) for p in list_checkpoints(trainer.run_dir)]:  # only in host memory: save it
            self.checkpointer.save(trainer, target)
        seconds = time.perf_counter() - start
        samples = sum(b - a + 1 for a, b in skip) * trainer.cfg.train.global_batch_size
        self._log(trainer, step, {"rewind": rewinds, "rewind_to": target, "skipped_batches": windows_text(skip),
                                  "samples_skipped": samples, "reason": why, "rewind_source": source,
                                  "rewind_seconds": seconds})
        trainer.say(f"rewind {rewinds}/{cfg.max_rewinds}: back to step {target} ({source}, {seconds:.2f}s), "
                    f"batches {windows_text(skip)} ({samples:,} samples) skipped"
                    + (f", learning rate x {cfg.lr_scale} until step {trainer.lr_scale_until}" if cfg.lr_steps
                       else ""))

    def _forget_after(self, trainer, target: int) -> None:
        """Checkpoints after `target` hold steps that are being trained again: removed (a resume must not find one)."""
        self.copies.drop_after(target)
        if dist.get_rank() == 0:
            for p in list_checkpoints(trainer.run_dir):
                if step_of(p) > target:
                    shutil.rmtree(p)
        dist.barrier()

    @staticmethod
    def _log(trainer, step: int, row: dict) -> None:
        if trainer.log is not None:
            trainer.log.log({"step": step, **row})

    # -- data or fault ---------------------------------------------------------------------------------------------
    def _rerun(self, trainer, target: int, step: int) -> str | None:
        """Replay steps target+1 .. step from checkpoint `target` (with spike.rerun=rotate, the spiking step with
        each data-parallel rank on its neighbour's batch) and compare every rank's loss share and gradient-shard
        norm with the first pass. None when they agree (the data); else which steps and ranks differ."""
        original = {k: trainer.local_stats.get(k) for k in range(target + 1, step + 1)}
        self._restore(trainer, target)
        rotate = trainer.cfg.spike.rerun == "rotate" and trainer.dp_size > 1
        trainer.replaying = True
        try:
            while trainer.step < step:
                trainer.rotate_data = rotate and trainer.step + 1 == step
                trainer.train_step(trainer.step)
                trainer.step += 1
                trainer.settle()
        finally:
            trainer.replaying, trainer.rotate_data = False, False
        mine = {k: (original[k], trainer.local_stats.get(k)) for k in original}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (trainer.dp_rank, mine))
        exact = trainer.device.type == "cpu" or trainer.cfg.train.deterministic

        def same(a, b) -> bool:
            return a == b if exact else abs(a - b) <= 1e-5 * max(abs(a), abs(b))

        for k in sorted(k for k in original if original[k] is not None):
            if rotate and k == step:
                # Rank r computed data-parallel rank r+1's batch: losses compared by batch, exactly (the same
                # weights and tokens); the gradient shards summed the same terms in another order: to 1e-4.
                by_dp = {dp: stats[k][0][0] for dp, stats in everyone}  # (first pass: each rank its own)
                differ = [r for r, (dp, stats) in enumerate(everyone)
                          if not same(stats[k][1][0], by_dp[(dp + 1) % trainer.dp_size])
                          or abs(stats[k][1][1] - stats[k][0][1]) > 1e-4 * max(stats[k][1][1], stats[k][0][1])]
                what = "loss of its neighbour's batch or gradient-shard norm"
            else:
                differ = [r for r, (_, stats) in enumerate(everyone)
                          if not all(same(a, b) for a, b in zip(*stats[k]))]
                what = "loss share or gradient-shard norm"
            if differ:
                return f"step {k}: rank(s) {', '.join(map(str, differ))} computed another {what}"
        return None
