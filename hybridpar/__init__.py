"""hybridpar: Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch."""

import os

# A CPU run repeats and resumes bit for bit only if each matmul adds in the same order every time. MKL (torch's CPU
# BLAS) by default may split a matmul differently from one process to the next: 3 of 15 fresh runs of one config
# logged another step-1 loss (2.7e-6 relative), with the same thread count. Its reproducible mode, on the fastest
# code path of the CPU at hand, made that config agree in 26 of 26 runs. It is not the whole story: a fresh process
# still logged another step-1 loss once since (tests/test_checkpoint.py, in a full suite). MKL reads this at its
# first call, which importing torch does not make; a value set by the user stays.
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
