"""Count the compute ops of one transformer block's forward + backward, per zoo family: the planner's estimate of
kernel launches per block and microbatch (hybridpar/planning/cost.py: KERNELS_PER_BLOCK).

    python benchmarks/kernels_per_block.py

torch.profiler on CPU records every aten op; the leaves (ops that call no other aten op), minus views and
allocations, are the ones that become device kernels. Fused kernels on a GPU (SDPA, fused AdamW) make the real
count somewhat lower; the count does not depend on the model's width.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from hybridpar.models.gpt import Where
from hybridpar.models import build_model, get_model_config

NOT_KERNELS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::view", "aten::_unsafe_view",
               "aten::_reshape_alias", "aten::reshape", "aten::t", "aten::transpose", "aten::permute",
               "aten::as_strided", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::unflatten",
               "aten::flatten", "aten::split", "aten::slice", "aten::select", "aten::unbind", "aten::detach",
               "aten::alias", "aten::resolve_conj", "aten::resolve_neg", "aten::lift_fresh", "aten::contiguous",
               "aten::result_type", "aten::is_same_size"}


def kernels_per_block(preset: str) -> int:
    cfg = get_model_config(preset, n_layers=1, d_model=256, n_heads=4, vocab_size=512, max_seq_len=128,
                           **({"n_kv_heads": 2} if get_model_config(preset).kv_heads != get_model_config(preset).n_heads
                              else {}))
    model = build_model(cfg, "cpu")
    rope = (model.rope_cos[None, :64], model.rope_sin[None, :64]) if cfg.position == "rope" else None
    block, rope = model.layers[0], Where(rope)
    x = torch.randn(2, 64, cfg.d_model, requires_grad=True)
    block(x, rope).sum().backward()  # warm-up: lazy initialisations out of the count
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        block(x, rope).sum().backward()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return sum(e.name not in NOT_KERNELS for e in leaves) - 1  # less the .sum() that stands in for the loss


if __name__ == "__main__":
    for preset in ("gpt2-124m", "gpt-modern-1b"):
        print(f"{preset}: {kernels_per_block(preset)} ops per block, forward + backward")
