"""Time the whole-index consistency check IndexedTokens runs on open, on a synthetic index of N sequences.

    python benchmarks/index_check.py --sequences 20000000
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from hybridpar.data.indexed import _HEADER, CODES, MAGIC, VERSION, IndexedTokens


def write_index(prefix: Path, n_seq: int, seed: int = 0) -> None:
    """An index of n_seq sequences (one document each, sizes 1..2048) and a sparse .bin of the matching length."""
    sizes = np.random.default_rng(seed).integers(1, 2049, n_seq, dtype=np.int32)
    pointers = np.zeros(n_seq, np.int64)
    np.cumsum(sizes[:-1].astype(np.int64) * 2, out=pointers[1:])
    docs = np.arange(n_seq + 1, dtype=np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODES[np.dtype(np.uint16)], n_seq, n_seq + 1))
        for a in (sizes, pointers, docs):
            f.write(a.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(sizes.sum(dtype=np.int64)) * 2)  # sparse: no disk used, the length is what is checked


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sequences", type=int, default=20_000_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        prefix = Path(d) / "synthetic"
        write_index(prefix, a.sequences)
        start = time.perf_counter()
        ds = IndexedTokens(prefix)
        seconds = time.perf_counter() - start
        print(f"{len(ds):,} sequences, {ds.n_tokens:,} tokens: open + full index check {seconds:.2f}s "
              f"({len(ds) / seconds / 1e6:.1f}M sequences/s)")


if __name__ == "__main__":
    main()
