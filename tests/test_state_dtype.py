"""The memory-lean recipe: optim.state_dtype=bf16 (AdamW's moments in bf16) and optim.master_dtype=bf16 (the weights
and gradients in bf16, each update rounded stochastically or with Kahan compensation), in
hybridpar.training.optim.LowPrecisionAdamW: against torch's AdamW, over training runs against fp32, resumed from
checkpoints, and in the planner's bytes."""

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


def test_stochastic_rounding_is_unbiased_to_the_last_bit():
    """Over all 2^16 values of the random bits, an fp32 value rounds up exactly in proportion to its distance from
    the bf16 below it (in magnitude): the mean of the roundings is the value itself (a hand count: up for
    low16(x) of the 65,536 draws), for positive, negative, tiny and large values; values bf16 holds stay put."""
    from hybridpar.training.optim import stochastic_bf16

    draws = torch.arange(2 ** 16, dtype=torch.int32)
    for v in (1.0 + 3 * 2 ** -10 + 2 ** -20, -2.5e-3 * (1 + 2 ** -9 + 2 ** -17), 3.3e-30, -7.77e5 - 1 / 3):
        x = torch.tensor(v, dtype=torch.float32)
        rounded = stochastic_bf16(x.expand(2 ** 16).contiguous(), draws)
        low16 = int(x.view(torch.int32)) & 0xFFFF
        down = float((x.view(torch.int32) & -65536).view(torch.float32))
        assert int((rounded.double().abs() > abs(down)).sum()) == low16
        assert float(rounded.double().mean()) == float(x)
    exact = torch.tensor([1.5, -0.25], dtype=torch.bfloat16).float()
    assert torch.equal(stochastic_bf16(exact, torch.full((2,), 65535, dtype=torch.int32)).float(), exact)


def test_rounding_bits_follow_the_element_not_the_shard():
    """A DTensor shard's element positions are its place in the whole tensor (a (2, 2) mesh, 7 x 10 split 4 + 3
    rows and 5 + 5 columns; rank 3 holds rows 4-6, columns 5-9), so its random bits are the whole tensor's there:
    every layout rounds each element alike. The bits change with the step, the seed and the tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hybridpar.training.optim import element_positions, rounding_bits

    step = torch.tensor(7.0)
    whole = rounding_bits(torch.arange(70).view(7, 10), 1234, step, 5)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rows", "cols"))
        shard = DTensor.from_local(torch.zeros(3, 5), mesh, [Shard(0), Shard(1)], run_check=False, shape=(7, 10),
                                   stride=(10, 1))
        positions = element_positions(shard)
    finally:
        dist.destroy_process_group()
    assert torch.equal(positions, torch.arange(70).view(7, 10)[4:, 5:])
    assert torch.equal(rounding_bits(positions, 1234, step, 5), whole[4:, 5:])
    for other in (rounding_bits(torch.arange(70).view(7, 10), 1234, step + 1, 5),
                  rounding_bits(torch.arange(70).view(7, 10), 1235, step, 5),
                  rounding_bits(torch.arange(70).view(7, 10), 1234, step, 6)):
        assert (other != whole).float().mean() > 0.99


MASTERS = {"fp32": [], "stochastic": ["--optim.master_dtype", "bf16", "--optim.state_dtype", "bf16"],
           "kahan": ["--optim.master_dtype", "bf16", "--optim.state_dtype", "bf16", "--optim.master_rounding",
                     "kahan"]}


def test_bf16_master_weights_follow_fp32_masters_over_200_steps_and_resume_exactly(tmp_path, cache_dir):
    """200 steps of bf16 compute with fp32 master weights (16 bytes a parameter) and with bf16 weights, gradients
    and moments (8; Kahan: 10): every 10-step mean of the loss from step 21 on within 0.5% of fp32's with Kahan
    (measured 0.23%) and 1.5% stochastically (measured 1.1%, the bf16 run lower); runs killed at step 100 resume to
    the same losses, bitwise (the compensation and the rounding's step key are in the checkpoint)."""
    cli = launcher("pretrain_gpt").cli
    base = [*SMALL, "--train.precision", "bf16", "--train.steps", "200", "--checkpoint.interval", "100",
            "--data.cache_dir", str(cache_dir)]
    curves = {}
    for name, extra in MASTERS.items():
        assert cli([*base, *extra, "--run.dir", str(tmp_path / name)]) == 0
        curves[name] = loss_curve(tmp_path / name)
    fp32 = curves["fp32"]

    def worst(curve):
        return max(abs(sum(curve[s] for s in range(a, a + 10)) / sum(fp32[s] for s in range(a, a + 10)) - 1)
                   for a in range(21, 192, 10))

    assert worst(curves["kahan"]) < 0.005 and worst(curves["stochastic"]) < 0.015
    assert curves["kahan"] != fp32 and curves["stochastic"] != curves["kahan"]
    for name in ("stochastic", "kahan"):
        assert cli([*base, *MASTERS[name], "--run.dir", str(tmp_path / f"{name}-resumed"), "--checkpoint.load",
                    str(tmp_path / name / "checkpoints" / "step_00000100")]) == 0
        again = loss_curve(tmp_path / f"{name}-resumed")
        assert {s: again[s] for s in range(101, 201)} == {s: curves[name][s] for s in range(101, 201)}, name


def test_a_resume_may_change_the_master_weights_dtype(tmp_path, cache_dir):
    """fp32 masters resume as bf16 ones (rounded to nearest once), stochastic rounding as Kahan (its compensation
    starts at zero), Kahan as fp32 (exact) and stochastic as fp32: each hop trains its 5 steps; after fp32 -> bf16
    the first step's loss is the unchanged run's (its forward computes with the same bf16 weights) and the next ones
    follow it within 1e-3."""
    cli = launcher("pretrain_gpt").cli
    base = [*SMALL, "--train.precision", "bf16", "--checkpoint.interval", "5", "--data.cache_dir", str(cache_dir)]
    assert cli([*base, "--train.steps", "10", "--run.dir", str(tmp_path / "fp32")]) == 0
    hops = (("fp32", 5, "stochastic"), ("stochastic", 10, "kahan"), ("kahan", 15, "back"), ("stochastic", 10, "fp32b"))
    for was, at, now in hops:
        optim = MASTERS[{"back": "fp32", "fp32b": "fp32"}.get(now, now)]
        assert cli([*base, *optim, "--train.steps", str(at + 5), "--run.dir", str(tmp_path / now), "--checkpoint.load",
                    str(tmp_path / was / "checkpoints" / f"step_{at:08d}")]) == 0, (was, now)
        assert sorted(loss_curve(tmp_path / now)) == list(range(at + 1, at + 6)), now
    fp32, changed = loss_curve(tmp_path / "fp32"), loss_curve(tmp_path / "stochastic")
    assert changed[6] == fp32[6]  # bf16 compute casts fp32 masters to nearest: the same forward as the loaded bf16
    assert changed[7] != fp32[7] and all(abs(changed[s] / fp32[s] - 1) < 1e-3 for s in range(7, 11))


def test_bf16_master_weights_are_refused_where_they_cannot_run():
    """One line each: without bf16 compute, with Muon, torch's fused kernel, exact reduction or float8."""
    from hybridpar.config.cli import ConfigError, load_config

    bf16 = ["--optim.master_dtype", "bf16", "--train.precision", "bf16"]
    for argv, said in ((["--optim.master_dtype", "bf16", "--train.precision", "fp32"], "set --train.precision bf16"),
                       ([*bf16, "--optim.name", "muon"], "optim.master_dtype=bf16 is AdamW's"),
                       ([*bf16, "--optim.fused", "true"], "drop optim.fused true"),
                       ([*bf16, "--parallel.exact_reduction", "true"], "parallel.exact_reduction"),
                       ([*bf16, "--train.fp8", "tensorwise"], "train.fp8=tensorwise")):
        with pytest.raises((ConfigError, ValueError), match=said):
            load_config(argv)


def test_kempnerforges_7b_on_one_h200_plans_with_the_lean_recipe():
    """KempnerForge's sweep row 1 (Llama-3 8B, one H200, micro-batch 2 x 4 of 4096, full checkpointing; its recipe
    of bf16 weights, gradients and moments: 80.7 GiB measured), planned through hybridpar's options: with
    optim.master_dtype and optim.state_dtype bf16 within 15% of the measured memory, and it starts; with fp32
    masters and moments it needs over 95% of the H200's usable memory (133.5 of 136.8 GiB: not refused, but 60 GiB
    more than the lean recipe), with bf16 moments alone 30 GiB less."""
    import published_runs as pr
    from dataclasses import replace

    from hybridpar.parallel.distributed import Layout, WorldInfo
    from hybridpar.planning.cost import GIB, GPUS, memory, plan_of
    from hybridpar.resolve import resolve

    row = pr.ROWS[0]
    assert (row.model, row.gpus, row.memory_gib) == ("7B", 1, 80.7)
    cfg = pr.config(row, lean=False)
    planned = {}
    for name, optim in (("fp32", {}), ("bf16 moments", {"state_dtype": "bf16"}),
                        ("bf16 recipe", {"state_dtype": "bf16", "master_dtype": "bf16"})):
        c = replace(cfg, optim=replace(cfg.optim, **optim))
        planned[name] = memory(plan_of(c, Layout(1, 1, 1)))["total_bytes_per_gpu"] / GIB
        run = resolve(c, WorldInfo(0, 1, 0, 1), torch.device("meta"), tokenizer=_Vocabulary(pr.VOCAB),
                      gpu=GPUS["h200"])
        assert (run.cfg.optim.master_dtype, run.cfg.optim.state_dtype) == (c.optim.master_dtype, c.optim.state_dtype)
    usable = GPUS["h200"].usable_bytes / GIB
    assert 0.95 * usable < planned["fp32"] < usable
    assert planned["fp32"] - planned["bf16 moments"] == pytest.approx(4 * 8.03e9 / GIB, rel=0.01)
    assert planned["bf16 moments"] - planned["bf16 recipe"] == pytest.approx(4 * 8.03e9 / GIB, rel=0.01)
    assert abs(planned["bf16 recipe"] / row.memory_gib - 1) < 0.15, planned
