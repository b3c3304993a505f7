"""Token streams, fixed-length windows, and the data-parallel slice of each global batch.

A split is one token stream: its documents tokenized, each followed by the end-of-document token, concatenated
(sequences are packed across document boundaries, as Megatron's GPTDataset does). Window w of a stream is the
`seq_len + 1` tokens starting at w * seq_len; inputs are its first seq_len tokens, targets its last seq_len.

The data position is one integer, the number of samples consumed. Sample i of the run is window perm_e[i mod n] of
epoch e = i // n, with perm_e a permutation seeded by (seed, e). Global batch s is samples [s*G, (s+1)*G); data-
parallel rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp) of it, cut into microbatches. The whole run's data
is therefore a pure function of (seed, step), whatever the layout, which is what makes loss curves comparable
across layouts and a resumed run exact.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridpar.config import DataConfig
from hybridpar.data.corpus import load_builtin_corpus, load_text_file
from hybridpar.data.tokenizer import load_tokenizer


@dataclass
class Corpus:
    """A tokenized corpus split into train/valid/test token streams."""
    tokenizer: object
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray
    sha256: str
    n_docs: int

    def unigram_loss(self) -> float:
        """Cross entropy (nats/token) of the validation stream under the train stream's unigram distribution
        (add-one smoothed): the loss a model that ignores context would reach. Learning means going below it."""
        counts = np.bincount(self.train, minlength=self.tokenizer.vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[self.valid].mean())


def _tokenize_split(docs: list[str], tokenizer) -> np.ndarray:
    ids = []
    for chunk in tokenizer.encode_batch(docs):
        ids.extend(chunk)
        ids.append(tokenizer.eod_id)
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    return np.asarray(ids, dtype=dtype)


def load_corpus(cfg: DataConfig) -> Corpus:
    """Read, split by document, tokenize (cached by corpus and tokenizer fingerprint) the corpus cfg names."""
    cache_dir = Path(os.path.expanduser(cfg.cache_dir))
    if cfg.path == "builtin":
        docs, sha = load_builtin_corpus(cache_dir)
    else:
        path = Path(cfg.path)
        if not path.is_file():
            raise ValueError(f"data.path={cfg.path!r}: no such file; give 'builtin' or a UTF-8 text file")
        docs, sha = load_text_file(path)
    f_train, f_valid, _ = cfg.split_fractions
    n_train = int(round(len(docs) * f_train))
    n_valid = int(round(len(docs) * (f_train + f_valid))) - n_train
    if n_train == 0 or n_valid == 0:
        raise ValueError(f"data.split={cfg.split!r} leaves an empty train or valid split of the {len(docs)} "
                         f"documents in data.path={cfg.path!r}; give more text or larger weights")
    parts = docs[:n_train], docs[n_train:n_train + n_valid], docs[n_train + n_valid:]
    tokenizer = load_tokenizer(cfg.tokenizer, parts[0], sha, cache_dir)
    streams = []
    for name, part in zip(("train", "valid", "test"), parts):
        path = cache_dir / f"tokens-{sha[:16]}-{cfg.split.replace(',', '_')}-{tokenizer.fingerprint}-{name}.npy"
        if path.is_file():
            arr = np.load(path)
        else:
            arr = _tokenize_split(part, tokenizer)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npy")
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(tmp, arr)
            os.replace(tmp, path)
        streams.append(arr)
    return Corpus(tokenizer, *streams, sha256=sha, n_docs=len(docs))


class TokenWindows:
    """Non-overlapping (seq_len + 1)-token windows of a stream, visited in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, shuffle: bool = True):
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"a split of {len(tokens)} tokens is shorter than one sequence of "
                             f"train.seq_len+1={seq_len + 1} tokens; lower train.seq_len or give more text")
        self._perm_epoch, self._perm = -1, None

    def _window(self, sample: int) -> int:
        epoch, i = divmod(sample, self.n_windows)
        if not self.shuffle:
            return i
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def batch(self, samples: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (b, T) and targets (b, T), int64, of the given global sample indices."""
        rows = []
        for s in samples:
            start = self._window(s) * self.seq_len
            rows.append(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        xy = torch.from_numpy(np.stack(rows))  # (b, T+1)
        return xy[:, :-1], xy[:, 1:]


class DataParallelBatches:
    """This data-parallel rank's microbatches of each global batch."""

    def __init__(self, windows: TokenWindows, global_batch: int, micro_batch: int, dp_rank: int, dp_size: int):
        assert global_batch % (micro_batch * dp_size) == 0, "checked by Config.check_world"
        self.windows, self.global_batch, self.micro_batch = windows, global_batch, micro_batch
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = global_batch // dp_size

    def microbatches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Microbatches of global batch `step` (0-based) for this rank."""
        first = step * self.global_batch + self.dp_rank * self.per_rank
        return [self.windows.batch(range(first + m, first + m + self.micro_batch))
                for m in range(0, self.per_rank, self.micro_batch)]


def validation_batches(windows: TokenWindows, n_batches: int, micro_batch: int, dp_rank: int,
                       dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation set: the first n_batches * micro_batch * dp_size windows in order (wrapping around
    when the split is smaller), this rank's contiguous share of them."""
    total = min(n_batches * micro_batch * dp_size, math.ceil(windows.n_windows / (micro_batch * dp_size))
                * micro_batch * dp_size)
    per_rank = total // dp_size
    first = dp_rank * per_rank
    return [windows.batch([i % windows.n_windows for i in range(first + m, first + m + micro_batch)])
            for m in range(0, per_rank, micro_batch)]
