"""How fast the provenance ledger answers for a run of 10^9 samples (hybridpar/data/provenance.py).

    python benchmarks/provenance_speed.py [--samples 1e9] [--global-batch 1024] [--docs 200000]

A synthetic staged run: two sources of --docs random documents each (20-200 tokens, written once as indexed
datasets), three stages with a ramp (web alone; a ramp to 0.5/0.5; 0.25 web 0.75 code), sequences of 64 tokens,
--samples positions. Each source's first pass is a real megatron-core GPTDataset (built into a temporary cache);
the further passes a run of that length needs are that same pass again (a real run builds one per pass, with its
own seed: the arithmetic per pass is the same, the index files are not built 10^4 times here). Prints the time of:
- the per-batch source counts over the whole run (draw_sources over every position; a run computes them at start,
  and a ledger once per process: the one cost that grows with the run's length);
- one step's ledger near the end of the run, after that;
- one document's steps over the whole run (every pass searched);
Figures and their dates are in docs/performance.md ("Provenance").
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=float, default=1e9)
    ap.add_argument("--global-batch", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=200_000)
    args = ap.parse_args()
    import torch.distributed as dist

    from hybridpar.data.gpt_data import build_passes
    from hybridpar.data.indexed import IndexedWriter
    from hybridpar.data.provenance import Ledger
    from hybridpar.data.stages import StagedDataset, StagePlan, StageSampler
    from hybridpar.data.tokenizer import ByteTokenizer

    work = Path(tempfile.mkdtemp(prefix="hybridpar-provenance-"))
    rng = np.random.default_rng(0)
    prefixes = []
    for name, lo in (("web", 1), ("code", 128)):
        prefixes.append(str(work / name))
        with IndexedWriter(prefixes[-1], np.uint16) as w:
            for n in rng.integers(20, 200, args.docs):
                w.add_document(np.append(rng.integers(lo, lo + 127, n), 0).astype(np.uint16))
    web, code = prefixes
    G, N = args.global_batch, int(args.samples) // args.global_batch * args.global_batch
    plan = StagePlan.parse([f"0: {web}", f"{N // G // 10} ramp {N // G // 10}: 0.5 {web} 0.5 {code}",
                            f"{N // G // 2}: 0.25 {web} 0.75 {code}"], global_batch=G, seq_len=64)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t0 = time.perf_counter()
    first = [build_passes(p, range(1), "100,0,0", (1.0, 0.0, 0.0), 64, 7, ByteTokenizer(), work / "cache")[0][0]
             for p in (web, code)]
    built = time.perf_counter() - t0
    sampler = StageSampler(plan, 7, G)
    t0 = time.perf_counter()
    drawn = sampler.counts_before(N // G)
    counts = time.perf_counter() - t0
    streams = [[ds] * -(-int(n) // len(ds)) for ds, n in zip(first, drawn)]
    ledger = Ledger(StagedDataset(sampler, streams, N, ["web", "code"]), G, [], N // G, {web: web, code: code})
    t0 = time.perf_counter()
    rows = ledger.step(N // G - 3)
    step = time.perf_counter() - t0
    t0 = time.perf_counter()
    found = ledger.document(code, 1234)
    document = time.perf_counter() - t0
    print(f"{N:,} samples ({N // G:,} steps of {G}); passes: web {len(streams[0])} x {len(first[0]):,} samples, "
          f"code {len(streams[1])} x {len(first[1]):,}; first passes built in {built:.1f} s")
    print(f"  per-batch counts over the run: {counts:.1f} s (once per process)")
    print(f"  one step's ledger ({len(rows)} samples): {step * 1e3:.0f} ms")
    print(f"  one document over the run: {document:.1f} s ({len(found)} samples, {len({r['step'] for r in found})} "
          f"steps)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
