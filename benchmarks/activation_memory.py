"""Activation memory kept for backward under each activation-checkpointing mode, measured.

Counts the bytes autograd saves during one forward (saved-tensor hooks; a checkpointed region saves nothing but
its inputs, which the hooks do not see as saved tensors, so this is what the mode keeps alive beyond the block
inputs). Runs on the CPU; the figures are per microbatch and do not depend on the device.

    python benchmarks/activation_memory.py --model gpt2-124m --batch 1 --seq-len 1024
"""

from __future__ import annotations

import argparse

import torch

from hybridpar.models import build_model, get_model_config
from hybridpar.parallel import apply_activation_checkpointing


def saved_bytes(model_name: str, mode: str, every: int, batch: int, seq_len: int) -> tuple[int, int]:
    """(bytes saved for backward, bytes of the block inputs a checkpointed block keeps)."""
    torch.manual_seed(0)
    model = build_model(get_model_config(model_name, dropout=0.0), device="cpu")
    apply_activation_checkpointing(model, mode, every)
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len))
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    n_ckpt_blocks = sum(1 for i in range(model.cfg.n_layers) if mode == "full" and i % every == 0)
    block_inputs = n_ckpt_blocks * batch * seq_len * model.cfg.d_model * 4
    return total, block_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    a = p.parse_args()
    print(f"{a.model}, batch {a.batch} x {a.seq_len} tokens, fp32, CPU (SDPA picks its fused attention kernel)")
    print(f"{'mode':<14} {'saved MiB':>10} {'+ block inputs MiB':>19} {'vs none':>8}")
    base = None
    for mode, every in (("none", 1), ("selective", 1), ("full", 2), ("full", 1)):
        saved, inputs = saved_bytes(a.model, mode, every, a.batch, a.seq_len)
        base = base or saved
        label = mode if mode != "full" else f"full/every {every}"
        print(f"{label:<14} {saved / 2**20:>10.1f} {inputs / 2**20:>19.1f} {(saved + inputs) / base:>8.2f}")


if __name__ == "__main__":
    main()
