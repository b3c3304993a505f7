"""Training rules checked against hand computations, not against the code itself: which parameters decay, that the
data order follows train.seed, that a huge but finite gradient is clipped and applied (only non-finite ones skip)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from conftest import run_cli
from hybridpar.config import OptimConfig
from hybridpar.models import build_model, get_model_config
from hybridpar.training.optim import build_optimizer


def test_weight_decay_applies_to_matrices_only():
    """GPT-3/nanoGPT rule: decay linear weights and embeddings, never biases or norm gains. One AdamW step with zero
    gradients moves nothing but the decay, so by hand: matrices become w * (1 - lr * wd), the rest stays bitwise."""
    torch.manual_seed(0)
    cfg = get_model_config("tiny", n_layers=2)
    model = build_model(cfg, device="cpu")
    lr, wd = 0.1, 0.5
    opt = build_optimizer(model, OptimConfig(lr=lr, min_lr=0.0, weight_decay=wd))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    # Listed by hand for the tiny GPT (tied LM head = the token embedding, counted once).
    per_layer = ["attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight", "mlp.up.weight",
                 "mlp.down.weight"]
    want = {"tok_embeddings.weight", "pos_embeddings.weight"} | {f"layers.{i}.{n}" for i in range(2) for n in per_layer}
    assert decayed == want
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.detach(), before[n] * (1 - lr * wd), rtol=1e-6, atol=0)
        else:
            assert torch.equal(p.detach(), before[n]), n  # biases, LayerNorm gains: untouched


def test_data_order_follows_the_seed(cache_dir):
    from hybridpar.config.cli import load_config
    from hybridpar.data.dataset import build_training_data
    from hybridpar.parallel.distributed import WorldInfo
    from hybridpar.resolve import resolve

    def first_batch(seed: int) -> torch.Tensor:
        cfg = load_config(["--train.seed", str(seed), "--train.global_batch_size", "8", "--train.seq_len", "64",
                           "--train.micro_batch_size", "8", "--data.cache_dir", str(cache_dir)])
        run = resolve(cfg, WorldInfo(0, 1, 0, 1), torch.device("cpu"))
        data = build_training_data(run.cfg, run.tokenizer, run.stages, dp_rank=0, dp_size=1)
        try:
            return torch.cat([x for x, _ in data.train.microbatches(0)])
        finally:
            data.close()

    a, b, c = first_batch(1234), first_batch(1234), first_batch(99)
    assert a.shape == (8, 64) and torch.equal(a, b)
    # Another seed reorders the samples: most of the first global batch's sequences differ.
    same_rows = sum(any(torch.equal(r, s) for s in c) for r in a)
    assert same_rows <= 2, same_rows


# A script of one train_step; @LOGGER@ (a syntax error until replaced) is where a test opens a logger or not.
HUGE_STEP = textwrap.dedent("""
    import json, sys
    import torch
    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import shutdown
    from hybridpar.session import start_trainer

    cfg = load_config(sys.argv[1:])
    trainer = start_trainer(cfg)
    @LOGGER@
    weight = trainer.model.layers[0].mlp.up.weight
    # One gradient made huge but finite: norm ~1e12 (torch's fp32 norm itself overflows past ~1e19).
    weight.register_hook(lambda g: g * 1e12)
    before = weight.detach().clone()
    _, norm, _ = trainer.train_step(0)
    print(json.dumps({"norm": float(norm), "skipped": trainer.state.skipped,
                      "change": float((weight.detach() - before).abs().max())}))
    shutdown()
""")


@pytest.mark.multiprocess
def test_huge_finite_gradient_is_clipped_and_applied(cache_dir):
    script = HUGE_STEP.replace("@LOGGER@", "trainer.open_log(enabled=False)")
    out = run_cli(["-c", script, "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
                   "--train.seq_len", "64", "--train.precision",
                   "fp32", "--data.cache_dir", str(cache_dir), "--logging.wandb.mode", "disabled",
                   "--optim.warmup_steps", "0"])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert 1e10 < r["norm"] < 1e14  # the huge norm is measured, finite
    assert r["skipped"] == 0  # and the step is not skipped:
    # clipped to norm 1, then Adam's first step moves each weight by about lr (3e-3; sign(g) * lr for a fresh state)
    assert 1e-3 < r["change"] < 1e-2


@pytest.mark.multiprocess
def test_non_finite_step_before_fit_warns_without_a_logger(cache_dir):
    """Trainer.train_step called directly (no fit(), so no metrics logger yet) with a NaN gradient: the step is
    skipped and the warning reaches the console instead of crashing on a missing logger."""
    script = HUGE_STEP.replace("@LOGGER@", "").replace("g * 1e12", "g * float('nan')")  # no logger
    out = run_cli(["-c", script, "--train.global_batch_size", "8", "--train.micro_batch_size", "8",
                   "--train.seq_len", "64", "--train.precision", "fp32", "--data.cache_dir", str(cache_dir),
                   "--logging.wandb.mode", "disabled"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warning: step 1: gradient norm is nan; optimizer step skipped (1 in a row, 1 in total)" in out.stdout
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["skipped"] == 1 and r["change"] == 0.0


NO_SYNC = textwrap.dedent("""
    import json, sys, threading
    import torch
    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import shutdown
    from hybridpar.session import start_trainer

    cfg = load_config(sys.argv[1:])
    trainer = start_trainer(cfg)
    weight = trainer.model.layers[0].mlp.up.weight
    poison = {"on": False}
    weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    trainer.train_step(0)  # the first step reads its batch in this thread (later ones come from the read-ahead)
    syncs = []
    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")
    originals = {n: getattr(torch.Tensor, n) for n in names}
    main = lambda: threading.current_thread() is threading.main_thread()
    for n in names:
        # counted in this thread only: the read-ahead thread's checks of token ids touch host data, not the device
        setattr(torch.Tensor, n, lambda self, *a, _n=n, **k: (main() and syncs.append(_n), originals[_n](self, *a, **k))[1])
    # Host-to-device copies that block on a GPU: a tensor made from Python data (torch.tensor, as_tensor), and a
    # move to a device without non_blocking in hybridpar's code (from a host tensor such a copy waits for all queued
    # work; onto the tensor's own device it does nothing and needs no .to). torch's own same-device .to calls
    # (get_total_norm's) are not counted.
    def moves(a, k):
        caller = sys._getframe(2).f_code.co_filename
        return ("/hybridpar/" in caller and ("device" in k or any(isinstance(v, (torch.device, str)) for v in a))
                and not k.get("non_blocking"))
    originals["to"] = torch.Tensor.to
    torch.Tensor.to = lambda self, *a, **k: (main() and moves(a, k) and syncs.append("blocking .to(device)"),
                                             originals["to"](self, *a, **k))[1]
    factories = {n: getattr(torch, n) for n in ("tensor", "as_tensor")}
    for n, f in factories.items():
        setattr(torch, n, lambda *a, _n=n, _f=f, **k: (main() and syncs.append(f"torch.{_n}"), _f(*a, **k))[1])
    before = []
    for step in (1, 2, 3):
        poison["on"] = step == 2
        before.append(weight.detach().clone())
        trainer.train_step(step)
    after = weight.detach().clone()
    for n, f in originals.items():
        setattr(torch.Tensor, n, f)
    for n, f in factories.items():
        setattr(torch, n, f)
    trainer.read_status()
    print(json.dumps({"syncs": syncs, "skipped": trainer.state.skipped,
                      "moved": [bool((b != a).any()) for b, a in zip(before, before[1:] + [after])]}))
    shutdown()
""")


@pytest.mark.multiprocess
def test_train_step_never_waits_on_the_device_with_the_fused_optimizer(cache_dir):
    """No host read inside train_step (counted by wrapping every Tensor-to-Python conversion), yet a non-finite step
    is still skipped (on the device: the fused AdamW's found_inf) and counted once its status is read."""
    out = run_cli(["-c", NO_SYNC, "--optim.fused", "true", "--train.global_batch_size", "8", "--train.micro_batch_size",
                   "4", "--train.seq_len", "64", "--train.precision", "fp32", "--data.cache_dir", str(cache_dir),
                   "--logging.wandb.mode", "disabled"])
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["syncs"] == [], r["syncs"]
    assert r["skipped"] == 1 and r["moved"] == [True, False, True]  # step 3 (index 1) was skipped, 2 and 4 applied
    assert "warning: step 3: gradient norm is nan; optimizer step skipped (1 in a row, 1 in total)" in out.stdout


@pytest.mark.parametrize("kernel", ["for-loop", "foreach", "fused"])
def test_adamw_takes_every_setting_and_its_second_step_equals_the_hand_computation(kernel):
    """Every optimizer hyperparameter reaches AdamW (swapped betas trained and passed before), and two steps on one
    weight equal the update written out by hand (Loshchilov & Hutter 2019, Algorithm 2, torch's eps placement):
    m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, w -= lr (wd w + m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps))."""
    import math

    cfg = OptimConfig(lr=0.01, min_lr=0.0, beta1=0.8, beta2=0.9, eps=1e-3, weight_decay=0.25,
                      fused=kernel == "fused", foreach=kernel == "foreach")
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, -0.5]]))
        model.bias.copy_(torch.tensor([0.1, -0.2]))
    opt = build_optimizer(model, cfg)
    for g in opt.param_groups:
        assert (g["lr"], g["betas"], g["eps"]) == (0.01, (0.8, 0.9), 1e-3)
        assert g["weight_decay"] == (0.25 if g["params"][0].dim() == 2 else 0.0)
        assert bool(g.get("fused")) == (kernel == "fused") and bool(g.get("foreach")) == (kernel == "foreach")
    grads = [[0.3, -0.1, 0.0, 1.0, 2.0, -0.5], [-0.2, 0.4, 0.1, 0.0, -1.0, 0.5]]  # two steps' weight gradients
    w = [0.5, -1.0, 2.0, 0.25, 0.0, -0.5]
    m, v = [0.0] * 6, [0.0] * 6
    for t, g in enumerate(grads, start=1):
        model.weight.grad = torch.tensor(g).reshape(2, 3)
        model.bias.grad = torch.zeros(2)
        opt.step()
        for j in range(6):  # by hand, in Python floats
            w[j] *= 1 - 0.01 * 0.25
            m[j] = 0.8 * m[j] + 0.2 * g[j]
            v[j] = 0.9 * v[j] + 0.1 * g[j] ** 2
            w[j] -= 0.01 * (m[j] / (1 - 0.8 ** t)) / (math.sqrt(v[j] / (1 - 0.9 ** t)) + 1e-3)
    torch.testing.assert_close(model.weight.detach().flatten(), torch.tensor(w), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.bias.detach(), torch.tensor([0.1, -0.2]))  # no decay, zero gradient
