"""What the trainer reads back of each step: the gradient norm, the ranks' stop votes and (when spikes are tested) the
global loss, one small device tensor per step, read on the host now or one step late (hybridpar.trainer). A
non-finite norm counts as a skipped step (its update was not applied on the device or was not called); a finite one
is tested for a loss spike (hybridpar.training.spikes.find_spike)."""

from __future__ import annotations

import math

import torch

from hybridpar.training.spikes import find_spike

LOCAL_STATS_STEPS = 10_000  # steps of this rank's own numbers kept for spike.rerun (a rerun compares those it has)


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row, or a loss spike after spike.max_rewinds rewinds."""


class StepStatus:
    """The Trainer's reading of its pending step statuses (`_pending`: (step, status) pairs); it keeps the skip
    counters, the spike window and the stop vote on the Trainer, where its state_dict() saves them."""

    def settle(self, keep_last: bool = False) -> bool:
        """Read the pending steps' (gradient norm, stop vote), oldest first, and act on them: count a non-finite
        step as skipped (its update was not applied) and warn, raise TrainingDiverged past
        train.max_skipped_steps, note a stop vote in stop_voted. keep_last leaves the newest step pending (its
        kernels may still run). Returns whether the last step read was finite (True when none was read)."""
        finite = True
        while len(self._pending) > (1 if keep_last else 0):
            finite = self._settle_one(*self._pending.pop(0))
        return finite

    def _settle_one(self, step: int, status: torch.Tensor) -> bool:
        norm_value, stop_value, *loss_value = status.tolist()
        stats = self.local_stats.get(step)
        if isinstance(stats, torch.Tensor):
            self.local_stats[step] = tuple(stats.tolist())
            self.local_stats.pop(step - LOCAL_STATS_STEPS, None)
        finite = math.isfinite(norm_value)
        if finite and loss_value:
            self._test_spike(step, loss_value[0], norm_value)
        if finite:
            self.consecutive_skips = 0
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.say(f"warning: step {step}: gradient norm is {norm_value}; optimizer step skipped "
                     f"({self.consecutive_skips} in a row, {self.skipped_steps} in total)")
            if self.consecutive_skips > self.cfg.train.max_skipped_steps:
                raise TrainingDiverged(f"{self.consecutive_skips} non-finite steps in a row (more than "
                                       f"train.max_skipped_steps={self.cfg.train.max_skipped_steps}); the last "
                                       f"complete checkpoint is intact: lower optim.lr or check the data, then resume")
        self.stop_voted = self.stop_voted or bool(stop_value)
        return finite

    def _test_spike(self, step: int, loss: float, norm: float) -> None:
        """The spike test of a finite step (train.spike warn or rewind): a spike is reported (and, with rewind, acted
        on at the end of the step) and kept out of the window; other steps enter it."""
        why = None if self.replaying or self.spike is not None else find_spike(self.cfg.spike, self.spike_history,
                                                                                  loss, norm)
        if why is None:
            if self.spike is None or self.replaying:
                self.spike_history = (self.spike_history + [(loss, norm)])[-self.cfg.spike.window:]
            return
        self.spike = (step, why)
        self.say(f"warning: step {step}: loss spike: {why}"
                 + ("" if self.cfg.train.spike == "rewind" else " (train.spike=warn: training on)"))
        if self.log is not None:
            self.log.log({"step": step, "spike": why, "spike_loss": loss, "spike_grad_norm": norm})
        if self.cfg.train.spike == "warn":
            self.spike = None
