"""hybridpar: hybrid tensor + data parallel GPT pretraining on PyTorch.

The zoo folder models/ installs as `hybridpar.models` (package_dir), so no top-level `models` package lands in
site-packages. NVIDIA apex is optional and detected at import; it is never a dependency (the PyPI package named
`apex` is an unrelated project).
"""

from setuptools import setup

setup(
    name="hybridpar",
    version="0.1.0",
    description="Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch",
    python_requires=">=3.10",
    packages=["hybridpar", "hybridpar.data", "hybridpar.parallel", "hybridpar.models"],
    package_dir={"hybridpar": "hybridpar", "hybridpar.models": "models"},
    install_requires=[
        "torch>=2.6",
        "numpy",
        "einops",
        "pyyaml",
        "wandb",
        "tokenizers>=0.15",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout"],
        "hf": ["transformers"],
    },
)
