"""Spike drills (tests/test_spikes.py, benchmarks/spike_drill.py): a copy of a run's data whose chosen global batches hold random tokens, for checking that loss-spike
detection and rewinds (train.spike) work on a real run before a real spike needs them.

The copy keeps every document's length, so megatron-core builds the same sample order from it: the run trained on
the copy meets the random tokens exactly at the batches named (batch N = the one step N trains when nothing is
skipped), and nowhere else.
"""

from __future__ import annotations

import shutil

import numpy as np

from hybridpar.data.dataset import train_batches
from hybridpar.data.gpt_data import build_gpt_datasets, open_blend
from hybridpar.data.indexed import bin_path, idx_path
from hybridpar.data.provenance import sample_parts
from hybridpar.data.tokenizer import load_tokenizer


def poison_batches(cfg, batches: list[int], out_prefix: str, seed: int = 0) -> int:
    """Write <out_prefix>.bin/.idx: cfg's data (one indexed prefix, cfg.data.path) with the tokens of global batches
    `batches` (1-based) replaced by uniformly random token ids of the tokenizer's vocabulary. Returns the tokens
    replaced."""
    d, t = cfg.data, cfg.train
    tokenizer = load_tokenizer(d.tokenizer)
    blend, indexes = open_blend(d.path)
    if len(blend) != 1:
        raise ValueError(f"data.path={d.path!r}: a drill copies one indexed prefix, not a blend")
    prefix = blend[0][1]
    sets = build_gpt_datasets(blend, indexes, d.split, d.split_fractions, t.seq_len, t.seed, tokenizer,
                              cfg.model.vocab_size, {"train": train_batches(cfg) * t.global_batch_size}, d.cache_path)
    train, tokens = sets["train"], indexes[prefix]
    shutil.copyfile(idx_path(prefix), idx_path(out_prefix))
    shutil.copyfile(bin_path(prefix), bin_path(out_prefix))
    data = np.memmap(bin_path(out_prefix), dtype=tokens.dtype, mode="r+")
    rng, replaced = np.random.default_rng(seed), 0
    for n in batches:
        for sample in range((n - 1) * t.global_batch_size, n * t.global_batch_size):
            for doc, begin, end in ((p.document, p.start, p.stop) for p in sample_parts(train, sample)[0]):
                start = int(tokens.sequence_pointers[doc]) // tokens.dtype.itemsize
                data[start + begin:start + end] = rng.integers(0, tokenizer.vocab_size, end - begin)
                replaced += end - begin
    data.flush()
    return replaced
