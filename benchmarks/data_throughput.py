"""Preprocessing throughput (MB/s, tokens/s) and loader throughput (samples/s), measured on this machine.

    python benchmarks/data_throughput.py [--repeat 4] [--workers 1 2]

The corpus is the built-in one (Python's documentation, about 2.6 MB of text), written as JSONL `--repeat` times
over; the BPE is the 4096-token one the default run trains. The loader reads global batches of 32 x (seq_len + 1)
tokens of one data-parallel rank (dp=1) without the background thread, so the figure is the read + assembly cost.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from hybridpar.config.cli import load_config
from hybridpar.data.corpus import load_builtin_corpus
from hybridpar.data.dataset import load_data_tokenizer
from hybridpar.data.gpt_data import GlobalBatchLoader, PlainSamples, build_gpt_datasets, open_blend
from hybridpar.data.preprocess import iter_documents, preprocess
from hybridpar.data.tokenizer import load_tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args()
    cache = Path(os.path.expanduser("~/.cache/hybridpar"))
    docs, _ = load_builtin_corpus(cache)
    bpe = load_data_tokenizer(load_config([]).data)  # the default run's train-bpe:4096
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bpe.save(tmp)
        corpus = tmp / "corpus.jsonl"
        with open(corpus, "w") as f:
            for _ in range(a.repeat):
                for d in docs:
                    f.write(json.dumps({"text": d}) + "\n")
        print(f"corpus: {corpus.stat().st_size / 1e6:.1f} MB of JSONL, {len(docs) * a.repeat:,} documents, "
              f"{os.cpu_count()} CPUs")
        for spec in ("bytes", f"bpe:{tmp / 'tokenizer.json'}"):
            for workers in a.workers:
                s = preprocess(iter_documents([corpus]), spec, tmp / f"out-{workers}", workers=workers,
                               tokenizer=load_tokenizer(spec))
                print(f"preprocess {spec.split(':')[0]:5} workers {workers}: {s.line()}")
        store = dist.FileStore(str(tmp / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            batches = 60
            train = build_gpt_datasets(*open_blend(str(tmp / f"out-{a.workers[-1]}")), "99,1,0", (0.99, 0.01, 0.0), a.seq_len, 0,
                                       bpe, 4096, {"train": 32 * batches}, tmp / "cache")["train"]
            loader = GlobalBatchLoader(PlainSamples(train, 8), 32, 0, 1, 4096, "train", prefetch=0)
            start = time.perf_counter()
            for s in range(batches):
                loader.load(s)
            dt = time.perf_counter() - start
            print(f"loader: {32 * batches / dt:,.0f} samples/s of {a.seq_len + 1} tokens "
                  f"({32 * batches * a.seq_len / dt / 1e6:.1f} M tokens/s), global batch 32, dp=1")
            loader.close()
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
