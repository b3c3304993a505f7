"""Positions in a run's train split, written once: steps, global batches and skipped windows. The trainer's state,
the loader, the skip checks, the rewind plan and the provenance ledger all ask here.

Batches are numbered from 1 as the steps of a run that skips nothing: batch N is samples [(N-1) G, N G) of the
train split (G the global batch). A run's skipped batches are a sorted list of inclusive (first, last) windows
(data.skip_batches, then each rewind's); step k then trains batch_number(k, windows), the k-th batch not in a
window. The windows are part of a checkpoint's trainer state, so a resumed run never trains them.
"""

from __future__ import annotations

import torch

from hybridpar.config import merge_windows


def batch_number(step: int, windows: list[tuple[int, int]]) -> int:
    """The batch that 1-based step `step` trains: the step-th batch outside the (sorted, merged) windows."""
    n = step
    for first, last in windows:
        if n < first:
            break
        n += last - first + 1
    return n


def step_of_batch(batch: int, windows: list[tuple[int, int]]) -> int | None:
    """The 1-based step that trains 1-based batch `batch` (the inverse of batch_number), None when it is skipped."""
    skipped = 0
    for first, last in windows:
        if first <= batch <= last:
            return None
        if last < batch:
            skipped += last - first + 1
    return batch - skipped


def windows_text(windows: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in windows)


def windows_tensor(windows: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(windows, dtype=torch.int64).reshape(-1, 2)


def windows_of(t: torch.Tensor) -> list[tuple[int, int]]:
    return merge_windows((int(a), int(b)) for a, b in t.reshape(-1, 2).tolist())
