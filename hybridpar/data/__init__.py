"""Data: corpora, tokenizers, and the per-rank batches of each step."""

from hybridpar.data.dataset import Corpus, DataParallelBatches, TokenWindows, load_corpus, validation_batches

__all__ = ["Corpus", "DataParallelBatches", "TokenWindows", "load_corpus", "validation_batches"]
