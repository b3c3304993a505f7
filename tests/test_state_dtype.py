"""optim.state_dtype=bf16: AdamW's moments stored in bf16 (hybridpar.training.optim.LowPrecisionAdamW), against
torch's AdamW, over a training run against fp32 moments, resumed from a checkpoint, and in the planner's bytes."""

from __future__ import annotations

import pytest
import torch

from conftest import launcher, loss_curve
from hybridpar.training.optim import LowPrecisionAdamW


def _pair(state_dtype, n=4096, steps=30, found_inf_at=None):
    """Torch's AdamW (the per-tensor loop) and LowPrecisionAdamW on the same weights and gradients."""
    torch.manual_seed(0)
    a = torch.randn(n, requires_grad=True)
    b = a.detach().clone().requires_grad_()
    hyper = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}], foreach=False, **hyper)
    ours = LowPrecisionAdamW([{"params": [b], "weight_decay": 0.1}], state_dtype=state_dtype, **hyper)
    for i in range(steps):
        g = torch.randn(n) * (1 + i)
        a.grad, b.grad = g.clone(), g.clone()
        if i == found_inf_at:  # torch's reference skips the step; ours is told by found_inf, on the device
            ours.found_inf = torch.tensor(1.0)
            ours.step()
            ours.found_inf = torch.tensor(0.0)
            continue
        ref.step()
        ours.step()
    return a, b, ref, ours


def test_fp32_moments_match_torchs_adamw_to_an_ulp():
    """The same arithmetic as torch's AdamW: with fp32 moments, 30 steps end within 2 fp32 ulps of the weights' scale
    of torch's (its bias corrections are Python floats, ours 0-dim tensors); a step skipped by found_inf changes
    nothing."""
    a, b, ref, ours = _pair(torch.float32, found_inf_at=7)
    assert (a - b).abs().max() <= 2 * 2 ** -23 * a.abs().max()
    assert ours.state[b]["step"].item() == ref.state[a]["step"].item() == 29
    assert torch.allclose(ours.state[b]["exp_avg"], ref.state[a]["exp_avg"], rtol=2 ** -21, atol=0)


def test_bf16_moments_are_the_fp32_ones_rounded():
    """Stored in bf16 (half the bytes), each moment within a bf16 rounding of torch's fp32 moment after one step
    (where both start from zero); after 30 steps the weights stay within 1e-3 relative of torch's."""
    a, b, ref, ours = _pair(torch.bfloat16, steps=1)
    m, m_ref = ours.state[b]["exp_avg"], ref.state[a]["exp_avg"]
    assert m.dtype == torch.bfloat16 and m.element_size() == 2
    assert ((m.float() - m_ref).abs() <= m_ref.abs() * 2 ** -8).all()  # round to nearest: half a bf16 ulp (2^-8)
    a, b, _, _ = _pair(torch.bfloat16, steps=30)
    assert (a - b).abs().max() <= 1e-3 * a.abs().max()
    assert not torch.equal(a, b)  # (the moments' rounding does show)


SMALL = ["--model.n_layers", "2", "--model.d_model", "64", "--model.n_heads", "4", "--train.global_batch_size", "8",
         "--train.seq_len", "64", "--train.eval_interval", "0", "--train.sample_tokens", "0", "--logging.interval",
         "1", "--logging.wandb.mode", "disabled", "--optim.warmup_steps", "20", "--optim.lr", "3e-3"]


def test_a_200_step_run_with_bf16_moments_follows_fp32_and_resumes_exactly(tmp_path, cache_dir):
    """200 steps of the same model and data, moments in fp32 and in bf16: the curves agree within 1% at every step
    from 20 on (their mean over the last 50 steps within 0.5%), and a bf16 run killed at step 100 and resumed from its
    checkpoint trains steps 101-200 with the same losses, bitwise."""
    cli = launcher("pretrain_gpt").cli
    curves = {}
    for dtype in ("fp32", "bf16"):
        run = tmp_path / dtype
        assert cli([*SMALL, "--train.steps", "200", "--optim.state_dtype", dtype, "--checkpoint.interval", "100",
                    "--data.cache_dir", str(cache_dir), "--run.dir", str(run)]) == 0
        curves[dtype] = loss_curve(run)
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert sorted(bf16) == list(range(1, 201)) and bf16 != fp32
    assert all(abs(bf16[s] / fp32[s] - 1) < 0.01 for s in range(20, 201)), max(
        abs(bf16[s] / fp32[s] - 1) for s in range(20, 201))
    late = [range(151, 201)]
    assert abs(sum(bf16[s] for s in late[0]) / sum(fp32[s] for s in late[0]) - 1) < 0.005
    resumed = tmp_path / "resumed"
    assert cli([*SMALL, "--train.steps", "200", "--optim.state_dtype", "bf16", "--checkpoint.interval", "100",
                "--checkpoint.load", str(tmp_path / "bf16" / "checkpoints" / "step_00000100"),
                "--data.cache_dir", str(cache_dir), "--run.dir", str(resumed)]) == 0
    again = loss_curve(resumed)
    assert {s: again[s] for s in range(101, 201)} == {s: bf16[s] for s in range(101, 201)}


def test_bf16_moments_are_adamws_alone_at_betas_bf16_can_hold():
    """Refused in one line: with Muon, with torch's fused kernel, and with a beta whose per-step change of a moment
    (1 - beta) is under bf16's rounding."""
    from hybridpar.config.cli import ConfigError, load_config

    for argv, said in ((["--optim.name", "muon"], "optim.state_dtype=bf16 is AdamW's"),
                       (["--optim.fused", "true"], "drop optim.fused true"),
                       (["--optim.beta2", "0.999"], "optim.beta2 <= 0.99")):
        with pytest.raises((ConfigError, ValueError), match=said):
            load_config(["--optim.state_dtype", "bf16", *argv])


class _Vocabulary:
    def __init__(self, n: int):
        self.vocab_size, self.spec = n, f"{n} tokens"


@pytest.mark.parametrize("layout_auto", [False, True])
def test_state_dtype_auto_takes_bf16_only_where_fp32_moments_do_not_fit(layout_auto):
    """optim.state_dtype auto, resolved for a GPU 1 MB above and 1 MB below what the plan with fp32 moments needs
    (gpt-modern-1b, one GPU): fp32 where it fits, bf16 below, and the start says which; with --parallel.layout auto,
    against the leanest layout the search has (it tries every layout with fp32 moments first)."""
    from dataclasses import replace

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import Layout, WorldInfo
    from hybridpar.planning.cost import GIB, GPUS, RESERVED_GIB, memory, plan_of
    from hybridpar.planning.layouts import candidate_layouts
    from hybridpar.resolve import resolve

    argv = ["--model.name", "gpt-modern-1b", "--train.precision", "bf16", "--train.global_batch_size", "8",
            "--optim.state_dtype", "auto", "--logging.wandb.mode", "disabled",
            *(["--parallel.layout", "auto"] if layout_auto else ["--train.micro_batch_size", "8"])]
    cfg = load_config(argv)

    def least(state):  # the plan's bytes with these moments: of the run's layout, or the leanest the search has
        c = replace(cfg, optim=replace(cfg.optim, state_dtype=state))
        configs = candidate_layouts(c, 1, 8) if layout_auto else [c]
        return min(memory(plan_of(x, Layout(1, 1, 1)))["total_bytes_per_gpu"] for x in configs)

    need = {s: least(s) for s in ("fp32", "bf16")}
    assert need["fp32"] - need["bf16"] > 4 * 10 ** 9  # 4 bytes a parameter of 1.2B
    for usable, want in ((need["fp32"] + 10 ** 6, "fp32"), (need["fp32"] - 10 ** 6, "bf16")):
        gpu = replace(GPUS["h100"], memory_gib=usable / GIB + RESERVED_GIB)
        run = resolve(cfg, WorldInfo(0, 1, 0, 1), torch.device("meta"), tokenizer=_Vocabulary(32000), gpu=gpu)
        assert run.cfg.optim.state_dtype == want, (usable, run.layout_choice)
        if not layout_auto:
            assert f"optim.state_dtype auto: {want} moments" in run.layout_choice


def test_a_resume_may_change_the_moments_dtype(tmp_path, cache_dir):
    """A checkpoint with fp32 moments resumes with bf16 ones (rounded to nearest) and back: steps 6-10 after the
    change follow the unchanged run's within 1e-5 relative (the moments' rounding), and the bf16 checkpoint loads into
    fp32 moments."""
    cli = launcher("pretrain_gpt").cli
    base = [*SMALL, "--train.steps", "10", "--checkpoint.interval", "5", "--data.cache_dir", str(cache_dir)]
    assert cli([*base, "--run.dir", str(tmp_path / "fp32")]) == 0
    assert cli([*base, "--optim.state_dtype", "bf16", "--run.dir", str(tmp_path / "bf16"), "--checkpoint.load",
                str(tmp_path / "fp32" / "checkpoints" / "step_00000005")]) == 0
    assert cli([*base, "--train.steps", "12", "--run.dir", str(tmp_path / "back"), "--checkpoint.load",
                str(tmp_path / "bf16" / "checkpoints" / "step_00000010")]) == 0
    fp32, bf16, back = (loss_curve(tmp_path / d) for d in ("fp32", "bf16", "back"))
    assert all(abs(bf16[s] / fp32[s] - 1) < 1e-5 for s in range(6, 11))
    assert any(bf16[s] != fp32[s] for s in range(6, 11))  # (the rounded moments do show)
    assert sorted(back) == [11, 12]
