"""launch/pretrain_gpt.py that records what each rank feeds the model, for the provenance test: `python
tests/feed_recorder.py OUT_DIR FAULT [pretrain_gpt arguments]` appends, at every step this process trains, a JSON
line to OUT_DIR/rank<global rank>.jsonl: the 1-based step, the data-parallel rank and size, and the inputs and
targets of its microbatches (token ids; -100 where a target is masked). FAULT is `-`, or RANK,STEP,FACTOR: the
gradient fault of tests/fault_drill.py (a spike to rewind from).

A step trained more than once (a rewind, a restart after a kill) is recorded each time: the last record of a step
is what the finished run trained."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fault_drill  # noqa: E402  (its import puts launch/ on the path)
import pretrain_gpt  # noqa: E402

from hybridpar.data.gpt_data import GlobalBatchLoader  # noqa: E402


def record(out: Path) -> None:
    microbatches = GlobalBatchLoader.microbatches

    def recorded(self, step, batch_for=lambda step: step):
        batch = microbatches(self, step, batch_for)
        if self.name == "train":
            rank = dist.get_rank()
            row = {"step": step + 1, "dp_rank": self.dp_rank, "dp_size": self.G // self.per_rank,
                   "x": [r for x, _ in batch for r in x.tolist()], "y": [r for _, y in batch for r in y.tolist()]}
            with open(out / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return batch

    GlobalBatchLoader.microbatches = recorded


if __name__ == "__main__":
    out, fault = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    record(out)
    if fault != "-":
        rank, step, factor = fault.split(",")
        fault_drill.inject(int(rank), int(step), float(factor))
    sys.exit(pretrain_gpt.cli(sys.argv[3:]))
