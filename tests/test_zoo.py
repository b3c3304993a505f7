"""The model zoo: presets, parameter counts against the GPT-3 paper, architecture by config fields, init."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import ROOT, run_cli
from hybridpar.models import GPT3_PAPER_PARAMS, build_model, count_params, get_model_config, list_models


def test_zoo_lists_every_family():
    names = list_models()
    for n in ["tiny", "gpt2-124m", "gpt2-355m", "gpt2-774m", "gpt2-1.5b", *GPT3_PAPER_PARAMS,
              "gpt-modern-1b", "gpt-modern-7b", "gpt-modern-13b"]:
        assert n in names


@pytest.mark.parametrize("name", sorted(GPT3_PAPER_PARAMS))
def test_gpt3_param_counts_match_paper(name):
    n = count_params(get_model_config(name))
    assert abs(n / GPT3_PAPER_PARAMS[name] - 1) < 0.02, (name, n)


def test_gpt2_124m_count_and_vocab_padding():
    cfg = get_model_config("gpt2-124m")
    assert cfg.vocab_size == 50304 and cfg.vocab_size % 128 == 0 and cfg.vocab_size >= 50257
    # 124,439,808 with the original 50257 rows; padding adds 47 * 768.
    assert count_params(cfg) == 124_439_808 + 47 * 768


def test_modern_presets_are_about_their_size():
    for name, target in [("gpt-modern-1b", 1e9), ("gpt-modern-7b", 7e9), ("gpt-modern-13b", 13e9)]:
        assert 0.85 < count_params(get_model_config(name)) / target < 1.15, name


def test_architecture_follows_fields_not_names():
    m = build_model(get_model_config("tiny", norm="rmsnorm", position="rope", mlp="swiglu", bias=False,
                                     tie_embeddings=False, n_kv_heads=2), device="cpu")
    names = dict(m.named_parameters())
    assert not any(n.endswith("bias") for n in names)
    assert "pos_embeddings.weight" not in names and "layers.0.mlp.gate.weight" in names
    assert m.lm_head.weight is not m.tok_embeddings.weight
    assert names["layers.0.attn.wk.weight"].shape == (2 * 32, 128)  # 2 kv heads of 32
    assert isinstance(m.norm, torch.nn.RMSNorm)
    tied = build_model(get_model_config("tiny"), device="cpu")
    assert tied.lm_head.weight is tied.tok_embeddings.weight


def test_meta_build_then_init_weights():
    cfg = get_model_config("tiny", n_layers=8)
    meta = build_model(cfg)
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(0)
    m = build_model(cfg, device="cpu")
    assert not any(p.is_meta for p in m.parameters())
    std = m.layers[0].attn.wq.weight.std().item()
    resid = torch.cat([m.layers[i].mlp.down.weight.flatten() for i in range(8)]).std().item()
    assert abs(std - 0.02) < 0.002
    assert abs(resid - 0.02 / math.sqrt(16)) < 0.0005
    assert torch.all(m.layers[0].attn.wq.bias == 0) and torch.all(m.layers[0].attn_norm.weight == 1)


@pytest.mark.parametrize("overrides", [{}, {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu",
                                            "n_kv_heads": 2, "tie_embeddings": False, "bias": False}])
def test_forward_shape_and_causality(overrides):
    torch.manual_seed(0)
    m = build_model(get_model_config("tiny", **overrides), device="cpu").eval()
    x = torch.randint(0, 4096, (2, 16))
    logits = m(x)
    assert logits.shape == (2, 16, 4096)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 4096  # changing the future must not change the past
    torch.testing.assert_close(m(x2)[:, :10], logits[:, :10])
    assert not torch.allclose(m(x2)[:, 10:], logits[:, 10:])


def test_attention_matches_explicit_gqa_rope_reference():
    """SDPA with enable_gqa and our RoPE against a hand-written softmax(QK^T/sqrt(d))V with repeated kv heads."""
    from hybridpar.models.gpt import Where, apply_rope

    torch.manual_seed(0)
    cfg = get_model_config("tiny", position="rope", n_kv_heads=2, bias=False, tie_embeddings=False)
    m = build_model(cfg, device="cpu")
    attn, x = m.layers[0].attn, torch.randn(2, 12, 128)
    rope = Where((m.rope_cos[None, :12], m.rope_sin[None, :12]))
    B, T, nh, hd = 2, 12, 4, 32
    q = attn.wq(x).view(B, T, nh, hd)
    k = attn.wk(x).view(B, T, 2, hd)
    v = attn.wv(x).view(B, T, 2, hd)
    # RoPE by the complex-number definition: (x0 + i x1) * exp(i * pos * theta_j)
    pos = torch.arange(T, dtype=torch.float32)[:, None]
    freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
    rot = torch.polar(torch.ones(T, hd // 2), pos * freqs)[None, :, None, :]
    def ref_rope(t):
        c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], hd // 2, 2)) * rot
        return torch.view_as_real(c).flatten(-2)
    torch.testing.assert_close(apply_rope(q, m.rope_cos[None, :T], m.rope_sin[None, :T]), ref_rope(q))
    q, k = ref_rope(q), ref_rope(k)
    k, v = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, -1), v).reshape(B, T, nh * hd)
    torch.testing.assert_close(attn(x, rope), attn.wo(y), atol=1e-5, rtol=1e-5)


def test_unknown_preset_suggests_names():
    with pytest.raises(ValueError, match="gpt3-1.3b"):
        get_model_config("gpt3-1.3")
    with pytest.raises(ValueError, match="n_heads=5 does not divide"):
        get_model_config("tiny", n_heads=5)


@pytest.mark.multiprocess
def test_model_zoo_cli_json_and_table():
    out = run_cli(["launch/model_zoo.py", "--json"])
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == set(list_models())
    assert by_name["gpt3-175b"]["n_params"] == count_params(get_model_config("gpt3-175b"))
    table = run_cli(["launch/model_zoo.py"])
    assert table.returncode == 0 and "gpt-modern-7b" in table.stdout and "kv" in table.stdout.splitlines()[0]


@pytest.mark.multiprocess
def test_models_package_has_no_distributed_import_and_installs_under_hybridpar(tmp_path):
    for f in (ROOT / "models").glob("*.py"):
        assert "torch.distributed" not in f.read_text(), f
    code = ("import importlib.util, hybridpar.models as m; "
            "print(importlib.util.find_spec('models') is None, importlib.util.find_spec('tests') is None, "
            "m.__name__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.split() == ["True", "True", "hybridpar.models"], out.stderr


@pytest.mark.parametrize("tied", [True, False])
def test_fused_loss_equals_logits_then_cross_entropy(tied):
    """GPT(x, targets) computes the summed loss in token chunks with the gradients made in the same pass: the same
    loss and gradients as logits -> cross_entropy (fp32 here, so to rounding), ignored targets counting zero."""
    from hybridpar.training.microbatch import token_loss_sum

    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", n_layers=2, tie_embeddings=tied), device="cpu")
    x = torch.randint(0, 4096, (3, 40))
    y = torch.randint(0, 4096, (3, 40))
    y[0, :7] = -100
    plain = token_loss_sum(model(x), y)
    (plain * 0.5).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    fused = model(x, targets=y, loss_chunk_tokens=17)  # 120 tokens: 7 full chunks and a short one
    (fused * 0.5).backward()
    fused, plain = fused.item(), plain.item()
    assert abs(fused - plain) <= 1e-6 * plain
    for n, p in model.named_parameters():
        if n.endswith("attn.wk.bias"):  # its true gradient is exactly 0 (softmax ignores it): rounding noise only
            assert float(p.grad.abs().max()) < 1e-6
            continue
        err = float((p.grad - want[n]).norm() / want[n].norm().clamp_min(1e-12))
        assert err < 1e-5, (n, err)
    with torch.no_grad():  # evaluation: the loss only
        assert abs(float(model(x, targets=y, loss_chunk_tokens=17)) - float(plain)) <= 1e-6 * float(plain)


def test_fused_loss_in_bf16_is_the_plain_path_rounded_alike():
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", n_layers=1), device="cpu").to(torch.bfloat16)
    x, y = torch.randint(0, 4096, (2, 64)), torch.randint(0, 4096, (2, 64))
    plain = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten(), reduction="sum")
    fused = model(x, targets=y, loss_chunk_tokens=50)
    assert fused.dtype == torch.float32
    assert abs(fused.item() - plain.item()) <= 1e-5 * plain.item()  # same bf16 logits, fp32 softmax


def test_an_imported_model_is_named_after_the_preset_of_its_shape():
    from dataclasses import replace

    from hybridpar.models import named_like_its_preset

    big = replace(get_model_config("gpt3-1.3b"), name="gpt2-124m", ffn_hidden_size=4 * 2048, vocab_size=50257)
    assert named_like_its_preset(big).name == "gpt3-1.3b"  # explicit widths equal to the preset's derived ones
    odd = replace(get_model_config("gpt3-1.3b"), name="gpt2-124m", n_layers=7)
    assert named_like_its_preset(odd).name == "gpt2-124m"  # no preset has 7 layers of 2048: kept
