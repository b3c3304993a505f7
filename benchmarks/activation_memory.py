"""Activation memory kept for backward under each activation-checkpointing mode: measured, and as the planner
(hybridpar.planning.cost) predicts it.

Counts the bytes autograd saves during one forward (saved-tensor hooks, each storage once, parameters excluded;
a checkpointed block shows up as the input it keeps). Runs on the CPU; the figures are per microbatch.

    python benchmarks/activation_memory.py --model gpt2-124m --batch 1 --seq-len 1024
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from hybridpar.planning.dry_run import saved_activation_bytes
from hybridpar.models import build_model, get_model_config
from hybridpar.parallel import apply_activation_checkpointing
from hybridpar.config.cli import load_config
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.cost import activation_bytes, plan_of


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-124m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--autocast", action="store_true", help="bf16 autocast (else fp32)")
    a = p.parse_args()
    cfg = get_model_config(a.model, dropout=0.0)
    print(f"{a.model}, batch {a.batch} x {a.seq_len} tokens, {'bf16 autocast' if a.autocast else 'fp32'}, CPU "
          f"(SDPA picks its fused attention kernel)")
    print(f"{'mode':<16} {'measured MiB':>12} {'planner MiB':>12} {'vs none':>8}")
    base = None
    plan = replace(plan_of(replace(load_config([]), model=cfg), Layout(1, 1, 1)), precision="bf16" if a.autocast
                   else "fp32", fsdp=False, sp=False, loss_chunk_tokens=0, compile=False, math_attention=False,
                   fp8="off")
    for mode, every in (("none", 1), ("selective", 1), ("full", 2), ("full", 1)):
        torch.manual_seed(0)
        model = build_model(cfg, device="cpu")
        apply_activation_checkpointing(model, mode, every)
        x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))
        saved = saved_activation_bytes(model, x, autocast=a.autocast)
        est = activation_bytes(replace(plan, micro=a.batch, seq_len=a.seq_len, ac=mode, ac_every=every))
        planned = est["layers"] + est["outside_layers"] + est.get("autocast_weight_copies", 0)
        base = base or saved
        label = mode if mode != "full" else f"full/every {every}"
        print(f"{label:<16} {saved / 2**20:>12.1f} {planned / 2**20:>12.1f} {saved / base:>8.2f}")
        del model
    # The loss: plain logits + fp32 cross entropy against the fused, chunked LM head + loss (train.loss_chunk_tokens).
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu")
    x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))
    y = torch.randint(0, cfg.vocab_size, (a.batch, a.seq_len))
    body = saved_activation_bytes(model, x, autocast=a.autocast)
    for loss in ("plain", "fused"):
        with_loss = saved_activation_bytes(model, x, autocast=a.autocast, targets=y, loss=loss)
        print(f"loss {loss:<11} {with_loss / 2**20:>12.1f} MiB with the loss ({(with_loss - body) / 2**20:+.1f} MiB "
              f"over the model's own activations)")


if __name__ == "__main__":
    main()
