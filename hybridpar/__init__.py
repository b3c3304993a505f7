"""hybridpar: Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch."""

import os

# A CPU run repeats and resumes bit for bit only if each matmul adds in the same order every time; MKL (torch's CPU
# BLAS) by default may not, from one process to the next (docs/checkpoints.md: measured, and what is still open).
# Its reproducible mode is read at MKL's first call, which importing torch does not make; a user's value stays.
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
