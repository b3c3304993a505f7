"""The checks that need a GPU to mean anything, each a small real run of hybridpar's trainer; run by
benchmarks/h200_check.sh, and on the CPU in its smoke mode (the same code, tiny sizes) by the test suite.

    python benchmarks/gpu_checks.py syncs --json syncs.json [training overrides]
    python benchmarks/gpu_checks.py bitwise --deterministic true --json bitwise.json [overrides]
    python benchmarks/gpu_checks.py attention --json attention.json [--model.name gpt-modern-1b]
    python benchmarks/gpu_checks.py compile --json compile.json [overrides]

syncs: host syncs inside train_step after warm-up. On CUDA, torch.cuda.set_sync_debug_mode("warn") reports every
  synchronising CUDA call; on the CPU, the Tensor-to-Python reads and blocking .to(device) calls are counted.
bitwise: two runs of the same seed in one process, losses and final weights compared bit for bit.
attention: one block of a grouped-query model forward and backward with only fused SDPA kernels allowed, in fp32
  and bf16: which dtype has a fused kernel (one without falls back to the math kernel, B x heads x T^2).
compile: graphs compiled and graph breaks after the first training step, and again after validation and the
  end-of-run sample (which must add none).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import warnings
from pathlib import Path

import torch

from hybridpar.config.cli import load_config
from hybridpar.parallel.distributed import shutdown
from hybridpar.session import start_trainer
from hybridpar.trainer import Trainer


def _trainer(overrides: list[str]) -> Trainer:
    cfg = load_config(overrides + ["--logging.wandb.mode", "disabled"])
    return start_trainer(cfg)


def check_syncs(overrides: list[str], steps: int = 4) -> dict:
    trainer = _trainer(overrides)
    trainer.train_step(0)  # warm-up: allocations, the optimizer's state, the first batch read in this thread
    trainer.read_status()
    found: list[str] = []
    if trainer.device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for step in range(1, steps + 1):
                trainer.train_step(step)
            torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        kind = "cuda sync debug mode"
    else:
        names = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy")
        originals = {n: getattr(torch.Tensor, n) for n in names}
        main = threading.main_thread()
        for n in names:
            setattr(torch.Tensor, n, lambda self, *a, _n=n, **k: (
                threading.current_thread() is main and found.append(_n), originals[_n](self, *a, **k))[1])
        try:
            for step in range(1, steps + 1):
                trainer.train_step(step)
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)
        kind = "host reads (CPU)"
    fused = all(g.get("fused") for g in trainer.optimizer.param_groups)
    trainer.read_status()
    trainer.data.close()
    return {"check": "syncs", "kind": kind, "steps": steps, "fused_adamw": fused, "syncs": len(found),
            "first": found[:5], "ok": not found or not fused}


def check_bitwise(overrides: list[str], steps: int = 5) -> dict:
    runs = []
    for _ in range(2):
        trainer = _trainer(overrides)
        losses = []
        for step in range(steps):
            loss, _, _ = trainer.train_step(step)
            losses.append(float(trainer.dp_sum(loss)))
        trainer.read_status()
        weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for n, p in trainer.model.named_parameters()}
        trainer.data.close()
        runs.append((losses, weights))
        del trainer
    (l1, w1), (l2, w2) = runs
    differ = [n for n in w1 if not torch.equal(w1[n], w2[n])]
    return {"check": "bitwise", "deterministic": torch.are_deterministic_algorithms_enabled(), "losses": [l1, l2],
            "losses_equal": l1 == l2, "tensors_differing": len(differ), "first_differing": differ[:3],
            "ok": l1 == l2 and not differ}


def check_attention(overrides: list[str]) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hybridpar.models import build_model
    from hybridpar.models.gpt import Where, rope_tables

    cfg = load_config(overrides + ["--model.n_layers", "1"])
    m = cfg.model
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    fused = ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
             if device.type == "cuda" else [SDPBackend.FLASH_ATTENTION])
    out = {"check": "attention", "model": m.name, "n_heads": m.n_heads, "kv_heads": m.kv_heads, "device": str(device)}
    block = build_model(m, device="meta", init=False).layers[0].to_empty(device=device)  # only one block
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    seq = cfg.train.seq_len
    for dtype in (torch.float32, torch.bfloat16):
        b = block.to(dtype)
        x = torch.randn(2, seq, m.d_model, device=device, dtype=dtype, requires_grad=True)
        rope = Where(tuple(t.to(dtype)[None] for t in rope_tables(m.head_dim, seq, m.rope_theta, device))
                     if m.position == "rope" else None)  # (1, T, hd/2) each, as GPT.forward passes them
        try:
            with sdpa_kernel(fused):
                b(x, rope).float().square().mean().backward()
            out[str(dtype).split(".")[1]] = "fused kernel"
        except RuntimeError as e:  # no fused kernel takes these inputs
            out[str(dtype).split(".")[1]] = "no fused kernel: " + str(e).splitlines()[0][:160]
    out["ok"] = out["bfloat16"] == "fused kernel"
    return out


def check_compile(overrides: list[str]) -> dict:
    from torch._dynamo.utils import counters

    trainer = _trainer(overrides + ["--train.compile", "true"])
    trainer.train_step(0)
    trainer.read_status()
    after_step = counters["stats"]["unique_graphs"]
    trainer.train_step(1)
    trainer.read_status()
    trainer.evaluator.validation()
    trainer.evaluator.sample("The ", 12, 0.8)
    trainer.data.close()
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    return {"check": "compile", "graphs_after_first_step": after_step, "graphs_after_eval_and_sample": graphs,
            "graph_breaks": sum(breaks.values()), "break_reasons": list(breaks)[:5],
            "ok": graphs == after_step and after_step > 0 and not breaks}


CHECKS = {"syncs": check_syncs, "bitwise": check_bitwise, "attention": check_attention, "compile": check_compile}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=list(CHECKS))
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--deterministic", default="false", choices=["true", "false"], help="bitwise: train.deterministic")
    a, rest = p.parse_known_args(argv)
    if a.check == "bitwise":
        rest += ["--train.deterministic", a.deterministic]
    try:
        result = CHECKS[a.check](rest)
    finally:
        shutdown()
    result.update(torch=torch.__version__,
                  device_name=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
