"""launch/pretrain_gpt.py whose train loader takes a known time: `python tests/slow_loader.py SECONDS [pretrain_gpt
arguments]` sleeps SECONDS in every train step's fetch of its microbatches (the call the step waits on), so the
run's data wait is known in advance (tests/test_goodput.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import pretrain_gpt  # noqa: E402

from hybridpar.data.gpt_data import GlobalBatchLoader  # noqa: E402


def slow(seconds: float) -> None:
    microbatches = GlobalBatchLoader.microbatches

    def slowed(self, step, batch_for=lambda step: step):
        if self.name == "train":
            time.sleep(seconds)
        return microbatches(self, step, batch_for)

    GlobalBatchLoader.microbatches = slowed


if __name__ == "__main__":
    slow(float(sys.argv[1]))
    sys.exit(pretrain_gpt.cli(sys.argv[2:]))
