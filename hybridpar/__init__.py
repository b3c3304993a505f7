"""hybridpar: Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch."""

__version__ = "0.1.0"
