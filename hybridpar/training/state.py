"""The training loop's one mutable record (TrainState): where the run is and what it decided on the way. A
checkpoint saves it, a resume or a rewind replaces it, and nothing else holds a copy of these numbers. Beside it,
what the loop returns (TrainResult) and a stop asked for by a signal (Stop)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.data.record import of_tensor, to_tensor
from hybridpar.data.positions import batch_number, windows_of, windows_tensor


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    consumed_samples: int = 0  # samples of all ranks trained so far (step x global batch)
    skipped: int = 0  # non-finite steps, in all
    skip_streak: int = 0  # non-finite steps in a row
    # Loss spikes (hybridpar.training.spikes): the batches never trained (data.skip_batches, then each rewind's), the
    # window of earlier (loss, grad norm) a spike test compares with, the rewinds done, the end of a rewind's
    # learning-rate scaling.
    skip_windows: list[tuple[int, int]] = field(default_factory=list)
    spike_history: list[tuple[float, float]] = field(default_factory=list)
    rewinds: int = 0
    lr_scale_until: int = 0
    # parallel.exact_reduction: each parameter's largest |microbatch gradient| in the last step (sorted by name),
    # which sets this step's integer grid (hybridpar.parallel.exact); None until a step measured them.
    exact_bounds: list[float] | None = None
    # The data each start read (hybridpar.data.record): segments, oldest first, append-only across resumes.
    data_segments: list[dict] = field(default_factory=list)

    def batch_for(self, step: int) -> int:
        """The 0-based global batch that 0-based step `step` trains: the step-th batch outside the skipped windows."""
        return batch_number(step + 1, self.skip_windows) - 1

    def state_dict(self) -> dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples, "skipped": self.skipped,
                "skip_streak": self.skip_streak, "skip_windows": windows_tensor(self.skip_windows),
                "spike_history": torch.tensor(self.spike_history, dtype=torch.float64).reshape(-1, 2),
                "rewinds": self.rewinds, "lr_scale_until": self.lr_scale_until,
                "exact_bounds": torch.tensor(self.exact_bounds or [], dtype=torch.float64),
                "data_record": to_tensor(self.data_segments)}

    def load_state_dict(self, saved: dict) -> None:
        """A checkpoint's record (ints or 0-d tensors; older checkpoints lack the spike fields and the streak)."""
        history = saved.get("spike_history")
        self.step, self.consumed_samples = int(saved["step"]), int(saved["consumed_samples"])
        self.skipped, self.skip_streak = int(saved["skipped"]), int(saved.get("skip_streak", 0))
        self.skip_windows = windows_of(saved["skip_windows"]) if "skip_windows" in saved else []
        self.spike_history = [] if history is None else [tuple(r) for r in history.reshape(-1, 2).tolist()]
        self.rewinds, self.lr_scale_until = int(saved.get("rewinds", 0)), int(saved.get("lr_scale_until", 0))
        bounds = saved.get("exact_bounds")
        self.exact_bounds = None if bounds is None or not bounds.numel() else bounds.reshape(-1).tolist()
        record = saved.get("data_record")  # (older checkpoints: none)
        self.data_segments = [] if record is None else of_tensor(record, "a checkpoint")

    def rewound_segments(self, segments: list[dict]) -> list[dict]:
        """The record after a rewind to this state's step from a process whose record is `segments`: the segments
        up to this step, then the one in force now, governing from here on (the steps after it are trained again)."""
        last = segments[-1]
        return [s for s in segments[:-1] if s["from_step"] < self.step] + [{**last, "from_step": min(
            last["from_step"], self.step)}] if segments else []

    @classmethod
    def of(cls, saved: dict) -> "TrainState":
        state = cls()
        state.load_state_dict(saved)
        return state


@dataclass
class TrainResult:
    losses: dict[int, float] = field(default_factory=dict)
    unigram_loss: float = float("nan")
    sample: str = ""
    wall_time: float = 0.0
    preempted: bool = False  # stopped early by a signal (after saving, when checkpointing is on)


@dataclass
class Stop:
    """A stop asked for by a signal (request), acted on at the end of the step (after the current microbatch
    when no checkpoint would be saved); voted: some rank asked (read from a step's status)."""
    requested: bool = False
    signum: int = 0
    voted: bool = False

    def request(self, signum: int) -> None:
        """A signal asked this process to stop."""
        self.requested, self.signum = True, signum

    def vote(self, device: torch.device) -> torch.Tensor:
        """1.0 on every rank when any rank was asked to stop, on the device (a fill kernel, not a host copy)."""
        flag = torch.full((), float(self.requested), device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def poll(self, device: torch.device) -> bool:
        """Whether any rank asked to stop, read now (between two evaluation batches or tasks)."""
        self.voted = self.voted or bool(self.vote(device))
        return self.voted
