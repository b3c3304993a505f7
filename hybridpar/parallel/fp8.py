"""fp8 training (train.fp8): torchao's float8 linears for the hidden matmuls, applied first in parallelize_gpt
(fp8 conversion -> TP -> activation checkpointing -> compile -> FSDP).

What changes: each converted nn.Linear becomes torchao's Float8Linear, which casts its input, weight and output
gradient to float8 (e4m3; e5m2 for gradients under tensorwise) with a dynamic scale and runs the three GEMMs of a
linear (output, input gradient, weight gradient) in float8, accumulating in high precision. The weights, the optimizer
and the checkpoints stay in the run's precision: fp8 is a training-time transform of the matmuls, so a checkpoint of
an fp8 run is an ordinary one (exports write plain weights) and resumes into fp8 or not.

Recipes (torchao's names):
- tensorwise: one scale per tensor. Under FSDP2 the weights are all-gathered in float8 (train.fp8_all_gather),
  their scales computed for every weight in one all-reduce before each step's forward
  (precompute_float8_dynamic_scale_for_fsdp).
- rowwise: one scale per row (power-of-two scales): slower kernels, closer to bf16; all-gathers in the run's
  precision.

Tensor parallelism uses DTensor's plain styles for both recipes: its activation all-gathers stay in the run's
precision. torchao's float8 TP styles (a cast before the all-gather) were tried and left out: gloo cannot all-gather
float8 tensors ("RuntimeError: Invalid scalar type", 2026-12-02), so under them the CPU suite could never run the
TP path a GPU takes; the cost is the sequence-parallel all-gathers' bytes (the run's precision instead of 1 byte).

Which linears: train.fp8_linears = hidden (the attention and MLP projections of every block) or all (also the LM
head). The embedding is a lookup, never converted. A linear whose dimensions are not multiples of 16 stays in the
run's precision (float8 GEMMs need them).

On CPU, and wherever the GPU has no float8 tensor cores, torchao's emulation (Float8LinearConfig.emulate) runs the
same casts and scales with the GEMMs in high precision: the suite checks the code path a GPU runs. A CUDA device of
compute capability < 8.9 is refused at start (resolve) rather than emulated: emulation there is slower than bf16.
torchao is imported only when train.fp8 is set.

Numerics across layouts: a dynamic scale is the amax of what a rank holds. Under data parallelism a rank's
activations are its own microbatch, so its scales differ from one process's over the whole batch, and rounding to
float8 turns summation-order differences of tensor parallelism into visible ones: fp8 curves of two layouts agree
within a measured tolerance, not bitwise (tests/test_fp8.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.errors import ConfigError

FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores
TORCHAO = "torchao==0.18.0"  # the version tested (torch >= 2.11); `pip install -e ".[fp8]"`


def _torchao_float8():
    """torchao.float8, imported only when a run asks for fp8 (its import warns about CUDA extensions a CPU or another
    torch build cannot load: they serve other torchao features, not float8 training)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "torchao":
            raise ConfigError(f"train.fp8 needs torchao, which is not installed; pip install {TORCHAO} (or "
                              f"pip install -e \".[fp8]\"), or use --train.fp8 off") from None
        from importlib.metadata import version

        installed = version("torchao")
        torch_version = torch.__version__.split("+")[0]
        raise ConfigError(f"train.fp8: torchao {installed} does not import under torch {torch_version} ({e}); "
                          f"pip install {TORCHAO} for torch >= 2.11, or torchao==0.14.1 for torch 2.9 (the pairs "
                          f"tools/torch_tier.sh ran), or use --train.fp8 off") from None
    return float8


def check_fp8(cfg: Config, device: torch.device, gpu=None) -> None:
    """train.fp8 for this run (hybridpar.resolve): torchao importable where the model is built (not on the meta
    device of the planner), and float8 tensor cores on a CUDA device, or on the GPU type planned for (gpu)."""
    if cfg.train.fp8 == "off":
        return
    if gpu is not None:
        if not gpu.peak_fp8_tflops:
            raise ConfigError(f"train.fp8={cfg.train.fp8} needs float8 tensor cores, and the planned GPU has none; "
                              f"plan an H100, H200 or B200, or use --train.fp8 off")
        return
    if device.type == "meta":
        return
    _torchao_float8()
    if device.type == "cuda":
        capability = tuple(torch.cuda.get_device_capability(device))
        if capability < FP8_MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise ConfigError(f"train.fp8={cfg.train.fp8} needs float8 tensor cores (compute capability >= 8.9: "
                              f"H100, H200, L40S, B200); {name} has {capability[0]}.{capability[1]}; use "
                              f"--train.fp8 off (bf16)")


def fp8_linear_names(model: nn.Module, which: str) -> list[str]:
    """The linears train.fp8 converts: every block's (hidden) or also the LM head's (all), each with both
    dimensions multiples of 16 (float8 GEMMs need them)."""
    return [name for name, m in model.named_modules() if type(m) is nn.Linear
            and (name.startswith("layers.") or (which == "all" and name == "lm_head"))
            and m.in_features % 16 == 0 and m.out_features % 16 == 0]


def convert_fp8(model: nn.Module, cfg: Config, emulate: bool, fsdp: bool) -> list[str]:
    """Swap train.fp8_linears for torchao's Float8Linear, in place (on the meta device, before TP: step 0 of
    parallelize_gpt); returns their names. emulate: the GEMMs in high precision (off CUDA). fsdp: the model will
    be fully_shard-ed, so tensorwise weights become float8 all-gather tensors (train.fp8_all_gather)."""
    t = cfg.train
    float8 = _torchao_float8()
    config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(t.fp8), emulate=emulate,
                                 enable_fsdp_float8_all_gather=t.fp8 == "tensorwise" and t.fp8_all_gather and fsdp)
    names = set(fp8_linear_names(model, t.fp8_linears))
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in names)
    return sorted(names)


def fp8_scales(model: nn.Module, cfg: Config):
    """With float8 all-gathers: a callable that computes every converted weight's scale in one all-reduce, from the
    weights as they are (the trainer calls it before each step's forward, so a start, a resume and a rewind cast
    with the scales of the weights they have); None otherwise."""
    if cfg.train.fp8 != "tensorwise" or not cfg.train.fp8_all_gather:
        return None
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
