"""What the trainer needs from the data: the tokenizer, this rank's train loader, the fixed validation batches.

data.path is 'builtin' (Python's own documentation, preprocessed once into a cached .bin/.idx with the tokenizer
data.tokenizer names) or one Megatron indexed-dataset prefix, or a weighted blend of them ('0.7 pathA 0.3 pathB').
Either way the samples come from megatron-core's GPTDataset: sequences of seq_len + 1 tokens packed across
document boundaries (each document ends with the EOD token), documents and samples shuffled from the seed.

Validation is a fixed set: the first train.eval_batches x global_batch_size samples of the valid split, split over
data-parallel ranks like a training batch, so its loss is the same number for every layout.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch.distributed as dist

from hybridpar.errors import ConfigError
from hybridpar.config import Config
from hybridpar.data.corpus import load_builtin_corpus
from hybridpar.data.gpt_data import GlobalBatchLoader, build_gpt_datasets, parse_blend, split_ranges
from hybridpar.data.indexed import IndexedTokens, idx_path
from hybridpar.data.preprocess import preprocess
from hybridpar.data.tokenizer import load_tokenizer

UNIGRAM_MAX_TOKENS = 50_000_000  # the unigram baseline reads the data once; skip it for large corpora


def prepare_builtin(cfg: Config, cache_dir: Path):
    """The built-in corpus as an indexed dataset in the cache (built once per corpus and tokenizer); returns
    (prefix, tokenizer, description). A trained tokenizer (train-bpe:N) learns from the train split's documents."""
    docs, sha = load_builtin_corpus(cache_dir)
    n_train = split_ranges(len(docs), cfg.data.split_fractions)[0][1]
    tokenizer = load_tokenizer(cfg.data.tokenizer, docs[:n_train], sha, cache_dir)
    prefix = cache_dir / f"builtin-{sha[:16]}-{tokenizer.fingerprint}"
    if not idx_path(prefix).is_file():
        # Several ranks may get here at once: each writes its own temporary files; the renames are atomic.
        tmp = prefix.with_name(f"{prefix.name}.{os.getpid()}")
        preprocess(iter(docs), cfg.data.tokenizer, tmp, tokenizer=tokenizer)
        for ext in (".bin", ".idx"):
            os.replace(f"{tmp}{ext}", f"{prefix}{ext}")
    return str(prefix), tokenizer, f"builtin ({len(docs)} documents, sha256 {sha[:12]})"


def check_vocab(cfg: Config, tokenizer, tp: int) -> None:
    """With model.vocab_from_tokenizer, set model.vocab_size to the tokenizer's vocabulary padded up to a multiple
    of vocab_multiple x tp (Megatron-LM's rule); else check that the given size holds the tokenizer's and divides by
    tp."""
    m, need = cfg.model, tokenizer.vocab_size
    pad = m.vocab_multiple * tp
    padded = pad * math.ceil(need / pad)
    if m.vocab_from_tokenizer:
        m.vocab_size = padded
        return
    if m.vocab_size < need:
        raise ConfigError(f"tokenizer {tokenizer.spec!r} has {need} tokens but model.vocab_size={m.vocab_size}; set "
                          f"--model.vocab_size {padded}, or leave it out to take the tokenizer's")
    if m.vocab_size % tp:
        raise ConfigError(f"model.vocab_size={m.vocab_size} does not divide by parallel.tp={tp}; set "
                          f"--model.vocab_size {tp * math.ceil(m.vocab_size / tp)}")


def unigram_loss(prefix: str, fractions, vocab_size: int) -> float:
    """Cross entropy (nats/token) of the valid split under the train split's unigram distribution (add-one
    smoothed): the loss of a model that ignores context. NaN for corpora over UNIGRAM_MAX_TOKENS."""
    data = IndexedTokens(prefix)
    if data.n_tokens > UNIGRAM_MAX_TOKENS:
        return float("nan")
    (tb, te), (vb, ve), _ = split_ranges(len(data), fractions)

    def tokens(beg, end):
        if end <= beg:
            return np.zeros(0, np.int64)
        start = int(data.sequence_pointers[beg]) // data.dtype.itemsize
        stop = int(data.sequence_pointers[end - 1]) // data.dtype.itemsize + int(data.sequence_lengths[end - 1])
        return np.asarray(data.tokens[start:stop])

    counts = np.bincount(tokens(tb, te), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    valid = tokens(vb, ve)
    return float(-logp[valid].mean()) if len(valid) else float("nan")


@dataclass
class TrainingData:
    tokenizer: object
    train: GlobalBatchLoader
    valid: list  # this rank's fixed validation microbatches
    description: str
    unigram_loss: float

    def close(self) -> None:
        self.train.close()

    def samples_line(self, needed: int, tokens: int) -> str:
        """How many training samples exist and why: train.steps x global batch asks for `needed`; the dataset is
        built in whole passes over its split, so it holds at least that many."""
        ds = self.train.dataset
        n = len(ds)
        try:  # a single GPTDataset: one pass = the split's tokens / seq_len
            per_pass = int(ds.dataset.sequence_lengths[ds.indices].sum()) // ds.config.sequence_length
        except AttributeError:  # a blend: its parts are built to their weights' shares
            return f"{n:,} train samples of {tokens} tokens (train.steps x global batch needs {needed:,})"
        passes = -(-needed // per_pass) if per_pass else 0
        return (f"{n:,} train samples of {tokens} tokens (train.steps x global batch needs {needed:,}: {passes} "
                f"pass(es) over the split's {per_pass:,})")


def build_training_data(cfg: Config, dp_rank: int, dp_size: int, tp: int, pin_memory: bool = False) -> TrainingData:
    d, t = cfg.data, cfg.train
    cache_dir = Path(os.path.expanduser(d.cache_dir))
    if d.path == "builtin":
        if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() != 0:
            dist.barrier()  # rank 0 builds the cached corpus, tokenizer and token files first
            path, tokenizer, description = prepare_builtin(cfg, cache_dir)
        else:
            path, tokenizer, description = prepare_builtin(cfg, cache_dir)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
    else:
        if d.tokenizer.startswith("train-bpe"):
            raise ConfigError(f"data.tokenizer={d.tokenizer!r} trains on the built-in corpus only; give the tokenizer "
                             f"your data was preprocessed with (bpe:PATH, gpt2:DIR, sentencepiece:MODEL or bytes)")
        path, tokenizer = d.path, load_tokenizer(d.tokenizer)
        description = " + ".join(f"{w:.2f} x {p}" for w, p in parse_blend(path)) if " " in path.strip() else path
    check_vocab(cfg, tokenizer, tp)
    n_valid = t.eval_batches * t.global_batch_size
    sets = build_gpt_datasets(path, d.split, d.split_fractions, t.seq_len, t.seed, tokenizer, cfg.model.vocab_size,
                              {"train": t.steps * t.global_batch_size, "valid": n_valid}, cache_dir)
    train = GlobalBatchLoader(sets["train"], t.global_batch_size, t.micro_batch_size, dp_rank, dp_size,
                              cfg.model.vocab_size, "train", pin_memory=pin_memory)
    valid_loader = GlobalBatchLoader(sets["valid"], t.global_batch_size, t.micro_batch_size, dp_rank, dp_size,
                                     cfg.model.vocab_size, "valid", prefetch=0)
    valid = [mb for k in range(t.eval_batches) for mb in valid_loader.load(k)] if t.eval_interval else []
    valid_loader.close()
    blend = parse_blend(path)
    unigram = unigram_loss(blend[0][1], d.split_fractions, tokenizer.vocab_size) if len(blend) == 1 else float("nan")
    return TrainingData(tokenizer, train, valid, description, unigram)
