"""hybridpar: Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch."""

import os

# A CPU run repeats and resumes bit for bit only if each matmul adds in the same order every time; MKL (torch's CPU
# BLAS) by default may not, from one process to the next (docs/checkpoints.md: measured, and what is still open).
# Its reproducible mode is read at MKL's first call, which importing torch does not make; a user's value stays.
# STRICT and MKL's dynamic threading off are Intel's conditions for the same bits run to run (oneMKL developer guide,
# "Reproducibility Conditions"); the trainer also fixes the thread count (parallel/distributed.py pick_device).
MKL_REPRODUCIBLE = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}
for _name, _value in MKL_REPRODUCIBLE.items():
    os.environ.setdefault(_name, _value)

__version__ = "0.1.0"
