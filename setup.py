"""hybridpar: hybrid tensor + data parallel GPT pretraining on PyTorch.

The zoo folder models/ installs as `hybridpar.models` (package_dir), so no top-level `models` package lands in
site-packages. NVIDIA apex is not used (its fused norms and optimizer would need GPU measurements against torch's
own fused kernels first) and never a dependency: the PyPI package named `apex` is an unrelated project.
"""

from setuptools import find_packages, setup

setup(
    name="hybridpar",
    version="0.1.0",
    description="Megatron-style hybrid tensor + data parallel GPT pretraining on PyTorch",
    python_requires=">=3.10",
    packages=[*find_packages(include=["hybridpar", "hybridpar.*"]), "hybridpar.models"],
    package_dir={"hybridpar": "hybridpar", "hybridpar.models": "models"},
    install_requires=[
        "torch>=2.9",  # the oldest torch the unit tier passed on (tools/torch_tier.sh; README)
        "numpy",
        "einops",
        "pyyaml",
        "wandb>=0.17",
        "tokenizers>=0.15",
        # The data layer (GPTDataset, BlendedDataset); hybridpar guards its 0.16 failure modes (see
        # hybridpar/data/gpt_data.py) and builds its datasets itself, so the minor version is pinned.
        "megatron-core==0.16.*",
        "sentencepiece",  # tokenizer spec sentencepiece:MODEL
        "zstandard",  # .zst inputs of launch/preprocess_data.py
        "safetensors",  # consolidated exports (to-torch, load_pretrained)
    ],
    extras_require={
        # wandb 0.31: tests/wandb_file.py reads that version's run files; transformers: HF round trips; matplotlib: plot_metrics; tensorboard: the TensorBoard writer;
        # psutil: megatron-core's dist_checkpointing.save, which writes the reference saves of tests/test_megatron.py;
        # lm-eval: the harness's hybridpar model type, tested against hybridpar's evaluator (tests/test_evaluate.py);
        # torchao: train.fp8, run through its CPU emulation (tests/test_fp8.py)
        "test": ["pytest>=7", "wandb==0.31.*", "pytest-timeout", "transformers", "matplotlib", "tensorboard", "psutil",
                 "lm-eval==0.4.13", "torchao==0.18.0"],
        "fp8": ["torchao==0.18.0"],  # train.fp8: torchao's float8 training (torch >= 2.11 for this version)
        "hf": ["transformers"],  # launch/convert_checkpoint.py to-hf / from-hf
        "plot": ["matplotlib"],  # launch/plot_metrics.py
        # launch/harness.py: lm-evaluation-harness with --model hybridpar; accelerate: lm-eval's own hf model, to score a
        # to-hf export side by side (docs/evaluation.md)
        "eval": ["lm-eval==0.4.13", "accelerate"],
        "tensorboard": ["tensorboard"],  # logging.tensorboard
    },
)
