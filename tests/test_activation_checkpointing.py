"""Activation checkpointing modes: the same gradients as none, and less kept for backward (measured by what
autograd saves and selective checkpointing caches)."""

from __future__ import annotations

import pytest
import torch

from hybridpar.planning.dry_run import saved_activation_bytes
from hybridpar.models import build_model, get_model_config
from hybridpar.parallel import apply_activation_checkpointing


def _run(mode: str, every: int = 1):
    torch.manual_seed(0)
    cfg = get_model_config("tiny", n_layers=4, vocab_size=512)
    model = build_model(cfg, device="cpu")
    apply_activation_checkpointing(model, mode, every)
    x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    # kept for backward: autograd's saved tensors, and what selective checkpointing caches
    return loss.item(), grads, saved_activation_bytes(model, x), model


def test_modes_give_identical_gradients_and_save_less():
    loss0, g0, bytes_none, _ = _run("none")
    results = {(mode, every): _run(mode, every) for mode, every in (("full", 1), ("full", 2), ("selective", 1))}
    for (mode, every), (loss, grads, _, _) in results.items():
        assert loss == loss0
        assert sorted(grads) == sorted(g0)
        for name, g in g0.items():
            assert torch.equal(grads[name], g), (mode, every, name)
    full_all, full_half, selective = (r[2] for r in results.values())
    assert full_all < full_half < bytes_none
    assert full_all < selective < bytes_none


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_selective_recomputes_no_matmul_and_full_recomputes_the_forward(mlp):
    """Matmul FLOPs of one forward + backward (torch's FlopCounterMode; it counts no attention kernel on the CPU):
    selective equals none (the output and down projections are neither kept nor recomputed); full recomputes each
    block's forward up to the down projection's input (recomputation stops once backward has what it needs)."""
    from torch.utils.flop_counter import FlopCounterMode

    def flops(mode: str) -> int:
        torch.manual_seed(0)
        cfg = get_model_config("tiny", n_layers=2, vocab_size=512, mlp=mlp)
        model = build_model(cfg, device="cpu")
        apply_activation_checkpointing(model, mode)
        x = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(1))
        with FlopCounterMode(display=False) as counter:
            model(x).float().sum().backward()
        return counter.get_total_flops()

    none, selective, full = flops("none"), flops("selective"), flops("full")
    cfg = get_model_config("tiny", n_layers=2, vocab_size=512, mlp=mlp)
    H, F, T, L = cfg.d_model, cfg.ffn_dim, 2 * 64, cfg.n_layers
    # by hand: q, k, v, o (4 H x H) and the MLP's up (and gate) H x F, 2 FLOPs a multiply-add, per token
    block = 2 * T * (4 * H * H + (2 if mlp == "swiglu" else 1) * H * F)
    assert selective == none and full == none + L * block


def test_wrapped_parameters_keep_their_names():
    _, _, _, model = _run("full", 2)
    plain = set(build_model(get_model_config("tiny", n_layers=4, vocab_size=512), device="meta",
                            init=False).state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    assert set(get_model_state_dict(model)) == plain


def test_bad_mode_is_a_config_error():
    from hybridpar.config.cli import ConfigError, load_config
    with pytest.raises(ConfigError, match="train.activation_checkpointing='some' is not one of none, full, selective"):
        load_config(["--train.activation_checkpointing", "some"])
    with pytest.raises(ValueError, match="train.ac_every=0 must be > 0"):
        load_config(["--train.ac_every", "0"])


def test_selective_under_fp8_keeps_every_projection_and_recomputes_no_matmul():
    """torchao's float8 linears (emulated on the CPU): selective keeps the output and down projections' outputs too
    (recomputation would otherwise redo them), so its FLOPs equal none's and its bytes are the planner's."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.fp8 import convert_fp8
    from dataclasses import replace

    from hybridpar.parallel.distributed import Layout
    from hybridpar.planning.cost import activation_bytes, plan_of

    cfg = load_config(["--model.name", "tiny", "--train.fp8", "tensorwise", "--train.precision", "fp32"])
    x = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(1))

    def run(mode: str):
        torch.manual_seed(0)
        model = build_model(cfg.model, device="cpu")
        convert_fp8(model, cfg, emulate=True, fsdp=False)
        apply_activation_checkpointing(model, mode)
        with FlopCounterMode(display=False) as counter:
            model(x).float().sum().backward()
        return counter.get_total_flops(), {n: p.grad for n, p in model.named_parameters()}, \
            saved_activation_bytes(model, x)

    (flops_none, grads_none, _), (flops, grads, kept) = run("none"), run("selective")
    assert flops == flops_none and all(torch.equal(grads[n], g) for n, g in grads_none.items())
    est = activation_bytes(replace(plan_of(cfg, Layout(1, 1, 1)), micro=2, seq_len=64, sp=False, precision="fp32",
                                   fsdp=False, ac="selective", loss_chunk_tokens=0, compile=False))  # (fp8 blocks)
    assert kept == est["layers"] + est["outside_layers"]
