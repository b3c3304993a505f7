"""train.spike=rewind, the choices: which checkpoint a loss spike goes back to and which batches it skips, and after
a rerun (spike.rerun), whether the replayed steps tell a fault from the data. The trainer acts on them
(hybridpar.trainer: the restore from host memory or disk, the replay, the removal of later checkpoints).

Every rank takes the same decisions: the spike test reads global values (the loss summed over data-parallel ranks,
the global gradient norm), and a rerun's verdict is gathered from all ranks. The skipped batches and the rewind
count are trainer state (checkpointed), and <run.dir>/skipped_batches.json holds them from the moment of the
rewind, so a run killed before its next checkpoint does not train them again on resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config import merge_windows
from hybridpar.training.spikes import batch_number, windows_text

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


class SpikeLimit(RuntimeError):
    """A spike after spike.max_rewinds rewinds."""


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
        raise SpikeLimit(f"loss spike at step {step} ({why}) after {rewinds} rewind(s), spike.max_rewinds="
                         f"{s.max_rewinds}: stopping; the skipped batches so far are {windows_text(windows) or 'none'}; "
                         f"look at the data near batch {batch_number(step, windows)}, lower optim.lr, or raise "
                         f"spike.max_rewinds, then resume")
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
