"""Data: tokenizers, Megatron indexed datasets, preprocessing, and the per-rank batches of each step."""

from hybridpar.data.dataset import TrainingData, build_training_data
from hybridpar.data.indexed import DataError, IndexedTokens, IndexedWriter

__all__ = ["DataError", "IndexedTokens", "IndexedWriter", "TrainingData", "build_training_data"]
