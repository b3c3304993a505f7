"""Data: tokenizers, the built-in corpus, deterministic windows and the data-parallel split of a global batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridpar.config import DataConfig
from hybridpar.data import DataParallelBatches, TokenWindows, load_corpus, validation_batches
from hybridpar.data.tokenizer import ByteTokenizer, load_tokenizer


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256


def test_builtin_corpus_and_trained_bpe(cache_dir):
    corpus = load_corpus(DataConfig(cache_dir=str(cache_dir)))
    tok = corpus.tokenizer
    assert tok.vocab_size == 4096 and corpus.n_docs > 3000
    assert 300_000 < len(corpus.train) and len(corpus.valid) > 10_000
    text = "Return the number of items in a container."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text) / 2.5  # a BPE trained on this text compresses it
    assert 5.5 < corpus.unigram_loss() < 8.0
    again = load_corpus(DataConfig(cache_dir=str(cache_dir)))  # from the cache: identical
    assert again.sha256 == corpus.sha256 and np.array_equal(again.train, corpus.train)


def test_bad_data_specs(tmp_path):
    with pytest.raises(ValueError, match="data.path='nope.txt': no such file"):
        load_corpus(DataConfig(path="nope.txt", cache_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="is not a tokenizer spec"):
        load_tokenizer("sentencepiece", [], "", tmp_path)
    with pytest.raises(ValueError, match="at least 512"):
        load_tokenizer("train-bpe:10", [], "", tmp_path)
    one = tmp_path / "one.txt"
    one.write_text("a single document")
    with pytest.raises(ValueError, match="empty train or valid split"):
        load_corpus(DataConfig(path=str(one), tokenizer="bytes", cache_dir=str(tmp_path)))


def test_windows_are_deterministic_and_cover_each_epoch():
    tokens = np.arange(1001, dtype=np.uint16)
    w = TokenWindows(tokens, seq_len=10, seed=3)
    assert w.n_windows == 100
    x, y = w.batch(range(100))
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = sorted(int(r[0]) for r in x)
    assert starts == list(range(0, 1000, 10))  # one epoch visits every window once
    x2, _ = TokenWindows(tokens, seq_len=10, seed=3).batch([5, 250, 7])
    assert torch.equal(x2[0], x[5]) and torch.equal(x2[2], x[7])
    x3, _ = TokenWindows(tokens, seq_len=10, seed=4).batch(range(100))
    assert not torch.equal(x3, x)


@pytest.mark.parametrize("dp_size, micro", [(1, 8), (2, 2), (4, 1), (2, 4)])
def test_data_parallel_ranks_partition_the_global_batch(dp_size, micro):
    w = TokenWindows(np.arange(5001, dtype=np.uint16), seq_len=10, seed=0)
    reference = torch.cat([x for x, _ in DataParallelBatches(w, 8, 8, 0, 1).microbatches(step=3)])
    parts = [x for r in range(dp_size) for x, _ in DataParallelBatches(w, 8, micro, r, dp_size).microbatches(3)]
    assert all(p.shape[0] == micro for p in parts)
    assert torch.equal(torch.cat(parts), reference)


def test_validation_batches_are_fixed_and_split_across_ranks():
    w = TokenWindows(np.arange(401, dtype=np.uint16), seq_len=10, seed=0, shuffle=False)
    one = torch.cat([x for x, _ in validation_batches(w, 2, 4, 0, 1)])
    two = torch.cat([x for r in range(2) for x, _ in validation_batches(w, 1, 4, r, 2)])
    assert torch.equal(one, two) and one.shape == (8, 10)
