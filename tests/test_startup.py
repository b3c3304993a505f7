"""Start-up at scale: keyed initialisation that does not depend on the layout, the same global initial weights for
1 process and every (dp_replicate, dp_shard, tp) layout (seed checkpoints of real gloo runs), a start-up memory
bound far below one full copy per rank, and a layout that cannot fit refused before allocating. (The planner's dry
run, which runs this start-up for one rank of 175B at 1,024 ranks, is checked in test_plan.py.)"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from conftest import run_cli
from hybridpar.checkpoint.dcp import load_full_model_state, read_trainer_state
from hybridpar.data.record import of_tensor
from hybridpar.checkpoint.layout import checkpoint_dir
from hybridpar.models import build_model, count_params, get_model_config
from hybridpar.models.init import TILE_COLS, TILE_ROWS, keyed_normal_


def test_any_block_of_a_keyed_tensor_equals_that_block_of_the_whole():
    shape = (3 * TILE_ROWS + 5, 2 * TILE_COLS + 7)  # ragged edges on both dims
    whole = keyed_normal_(torch.empty(shape), 0.02, seed=7, key="w")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # random rectangles, as row shards, column shards or both would hold
        r0, c0 = (int(torch.randint(0, n, (1,), generator=g)) for n in shape)
        h = int(torch.randint(1, shape[0] - r0 + 1, (1,), generator=g))
        w = int(torch.randint(1, shape[1] - c0 + 1, (1,), generator=g))
        part = keyed_normal_(torch.empty(h, w), 0.02, seed=7, key="w", global_shape=shape, offset=(r0, c0))
        assert torch.equal(part, whole[r0:r0 + h, c0:c0 + w])
    vec = keyed_normal_(torch.empty(5000), 1.0, seed=7, key="v")
    assert torch.equal(keyed_normal_(torch.empty(1000), 1.0, 7, "v", (5000,), (1234,)), vec[1234:2234])
    # A normal distribution with the asked std (hand reference: 5000 draws, mean and std within a few sigma).
    assert abs(float(vec.mean())) < 4 / math.sqrt(5000) and abs(float(vec.std()) - 1.0) < 0.05
    # The key and the seed matter; the tensor's dtype and device do not change the values.
    assert not torch.equal(keyed_normal_(torch.empty(5000), 1.0, 7, "u"), vec)
    assert not torch.equal(keyed_normal_(torch.empty(5000), 1.0, 8, "v"), vec)
    assert torch.equal(keyed_normal_(torch.empty(5000, dtype=torch.float64), 1.0, 7, "v").float(), vec)


def _seed_checkpoint(tmp_path, cache_dir, name, layout=None):
    run_dir = tmp_path / name
    args = ["launch/pretrain_gpt.py", "--model.n_layers", "2", "--train.steps", "0", "--checkpoint.interval", "1",
            "--train.global_batch_size", "8", "--train.seq_len", "64", "--train.precision", "fp32",
            "--logging.wandb.mode", "disabled", "--data.cache_dir", str(cache_dir), "--run.dir", str(run_dir)]
    if layout is not None:
        r, s, t = layout
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r * s * t}", *args,
                "--parallel.dp_replicate", str(r), "--parallel.dp_shard", str(s), "--parallel.tp", str(t)]
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = checkpoint_dir(run_dir, 0)
    state = read_trainer_state(ckpt)
    record = of_tensor(state.pop("data_record"), str(ckpt))  # the start's data record (hybridpar.data.record)
    assert [(s["from_step"], s["config"]["train"]["steps"], s["allowed_change"]) for s in record] == [(0, 0, False)]
    assert state == {"step": 0, "consumed_samples": 0, "skipped": 0, "skip_streak": 0,
                     "skip_windows": [], "spike_history": [], "rewinds": 0, "lr_scale_until": 0,
                     "exact_bounds": []}
    return load_full_model_state(ckpt)


@pytest.fixture(scope="module")
def one_process_init(tmp_path_factory, cache_dir):
    return _seed_checkpoint(tmp_path_factory.mktemp("seed"), cache_dir, "single")


@pytest.mark.multiprocess  # the fixture runs the launcher
def test_seed_checkpoint_holds_the_models_own_init(one_process_init):
    # Second path to the same numbers: the plain model's init_weights(seed), no trainer, no checkpoint.
    want = build_model(get_model_config("tiny", n_layers=2), device="cpu", seed=1234).state_dict()
    got = one_process_init
    assert "tok_embeddings.weight" in got and set(got) <= set(want)
    for k, v in got.items():
        assert torch.equal(v, want[k]), k


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", [(1, 4, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)], ids=lambda l: "r%ds%dt%d" % l)
def test_initial_weights_are_bitwise_equal_for_every_layout(layout, one_process_init, tmp_path, cache_dir):
    got = _seed_checkpoint(tmp_path, cache_dir, "sharded", layout)
    assert set(got) == set(one_process_init)
    for k, v in one_process_init.items():
        assert torch.equal(got[k], v), k


MEASURE = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)  # the largest process: one rank (Linux: KiB)
sys.exit(rc)
"""


@pytest.mark.multiprocess
def test_start_up_memory_per_rank_is_a_shard_not_the_model(tmp_path, cache_dir):
    """gpt2-774m on 4 ranks (dp_shard 4) writes its seed checkpoint: each rank's peak RSS stays within a quarter of
    the fp32 weights plus 1 GiB (one full copy per rank, as before, was 4.4-4.8 GB)."""
    run_dir = tmp_path / "big"
    out = run_cli(["-c", MEASURE, sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node=4", "launch/pretrain_gpt.py", "--model.name", "gpt2-774m", "--train.steps", "0",
                   "--checkpoint.interval", "1", "--train.global_batch_size", "4", "--train.seq_len", "64",
                   "--train.precision", "fp32", "--logging.wandb.mode", "disabled", "--data.cache_dir",
                   str(cache_dir), "--run.dir", str(run_dir)])
    assert out.returncode == 0, out.stderr[-3000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    weights = 4 * count_params(get_model_config("gpt2-774m"))
    assert peak <= weights / 4 + 2 ** 30, (peak, weights)
    assert (checkpoint_dir(run_dir, 0) / "COMPLETE").is_file()


def test_a_layout_that_cannot_fit_is_refused_with_one_that_does():
    from hybridpar.config.cli import load_config
    from hybridpar.errors import ConfigError
    from hybridpar.planning.layouts import refuse_if_too_big
    from hybridpar.parallel.distributed import Layout
    from hybridpar.planning.cost import GIB, GPUS

    cfg = load_config(["--model.name", "gpt3-1.3b", "--train.seq_len", "2048", "--train.global_batch_size", "8",
                       "--train.micro_batch_size", "8", "--train.precision", "bf16"])
    # Hand lower bound: fp32 weights + fp32 gradients + two AdamW moments = 16 bytes per parameter.
    floor = 16 * count_params(cfg.model) / GIB
    with pytest.raises(ConfigError, match=r"the plan needs (\d+\.\d) GiB per GPU but A100-40GB has 37.0 GiB usable; "
                                          r"the planner's fastest layout that fits: .*--train.micro_batch_size 4") as e:
        refuse_if_too_big(cfg, Layout(1, 1, 1), 37 * GIB, 1, GPUS["a100"], "A100-40GB")
    assert float(str(e.value).split("needs ")[1].split(" GiB")[0]) > floor
    # 4 x 2 microbatches fit only reduce-scattering each one: holding the gathered bf16 model and its fp32
    # gradients between them adds 6 bytes per parameter (7.8 GB here), past the 37 GiB
    assert "--train.micro_batch_size 4" in str(e.value) and "--parallel.accumulate_unsharded false" in str(e.value)
    held = load_config(["--model.name", "gpt3-1.3b", "--train.seq_len", "2048", "--train.global_batch_size", "8",
                        "--train.micro_batch_size", "4", "--train.precision", "bf16",
                        "--train.activation_checkpointing", "selective", "--parallel.accumulate_unsharded", "true"])
    with pytest.raises(ConfigError, match="the plan needs"):
        refuse_if_too_big(held, Layout(1, 1, 1), 37 * GIB, 1, GPUS["a100"], "A100-40GB")
    with pytest.raises(ConfigError, match="no layout of 1 GPU.s. fits this model and batch"):
        refuse_if_too_big(cfg, Layout(1, 1, 1), 13 * GIB, 1, GPUS["a100"], "a 16 GiB GPU")
    refuse_if_too_big(cfg, Layout(1, 1, 1), 138 * GIB, 1, GPUS["h200"], "H200")  # fits: no error


def test_gpu_placement_under_srun_with_one_gpu_bound_per_task(monkeypatch):
    """srun without torchrun and --gpus-per-task=1: each task sees only its own GPU (CUDA_VISIBLE_DEVICES), so
    local rank 3 must take device 0, and the node still has 4 GPUs for tensor parallelism. CUDA's getters are
    patched: this is the launch logic a GPU node runs, on the CPU."""
    import torch

    from hybridpar.config.cli import load_config
    from hybridpar.parallel.distributed import cuda_index, gpus_per_node, pick_device, process_group_options, world_from_env
    from hybridpar.errors import ConfigError
    from hybridpar.parallel import check_layout

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    world = world_from_env({"SLURM_PROCID": "7", "SLURM_NTASKS": "8", "SLURM_LOCALID": "3",
                            "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "node[1-2]"})
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (7, 8, 3, 4)
    device = pick_device("auto", world.local_rank)
    assert device == torch.device("cuda", 0) and chosen == [0]
    assert gpus_per_node(device, world) == 4
    check_layout(load_config(["--parallel.tp", "4"]), (1, 2, 4), gpus_per_node(device, world))  # tp 4 allowed
    options = process_group_options(load_config([]).parallel, device)
    assert options["backend"] == "nccl" and options["device_id"] == torch.device("cuda", 0)
    assert "device_id" not in process_group_options(load_config([]).parallel, torch.device("cpu"))
    # every GPU of the node visible (torchrun, or srun without binding): the local rank indexes them
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pick_device("cuda", 3) == torch.device("cuda", 3) and chosen[-1] == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="local rank 3 sees 2 GPUs .*start at most 2 ranks per node"):
        cuda_index(3)


def test_tf32_and_deterministic_settings_reach_torch():
    import os

    import torch

    from hybridpar.parallel.distributed import set_numerics

    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32)
    try:
        set_numerics(deterministic=True, tf32=True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        set_numerics(deterministic=False, tf32=False)
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]


@pytest.mark.multiprocess
@pytest.mark.parametrize("mistake, said", [
    (["--train.steps", "abc"], "error: train.steps='abc' is not a valid int"),  # parsed: before any process group
    (["--train.global_batch_size", "7"],  # resolved: with the process group up (rank 1 waits on its store)
     "error: train.global_batch_size=7 is not divisible by the data-parallel size 2; use a multiple of 2")],
    ids=["parsed", "resolved"])
def test_a_command_line_mistake_is_said_once_not_once_per_rank(mistake, said, tmp_path):
    """torchrun hands every rank the same command line: a bad value is every rank's error, and rank 0 alone says it
    (each of the ranks printed it before; and once rank 1 exited first, so torchrun stopped rank 0 before it said
    it); every rank still exits 2. (The suite's real torchrun launches of 2 ranks; the other 2-rank launcher runs go
    to the warm worlds of tests/warm.py.)"""
    out = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "launch/pretrain_gpt.py",
                   *mistake, "--run.dir", str(tmp_path / "run")], warm=False)  # a real torchrun
    ours = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [said], out.stderr[-3000:]
    assert out.returncode != 0 and "exitcode  : 2" in out.stderr and not (tmp_path / "run").exists()


def test_a_session_puts_back_the_handlers_it_found_and_a_finished_run_does_nothing(tmp_path, cache_dir, capsys):
    """In this process (no warm world to put the handlers back behind it): the session's stop handlers replace the
    caller's while it trains and the caller's are back after it, on success and after an error. The same command
    again on the run that finished at train.steps says so, trains nothing and writes nothing."""
    import signal

    from hybridpar.config.cli import load_config
    from hybridpar.session import STOP_SIGNALS, Session

    def mine(*_):
        pass

    before = {s: signal.signal(s, mine) for s in STOP_SIGNALS}
    run_dir = tmp_path / "run"
    cfg = load_config(["--model.n_layers", "1", "--train.steps", "2", "--checkpoint.interval", "2",
                       "--train.global_batch_size", "8", "--train.seq_len", "32", "--train.eval_interval", "0",
                       "--train.sample_tokens", "0", "--logging.wandb.mode", "disabled", "--data.cache_dir",
                       str(cache_dir), "--run.dir", str(run_dir)])
    try:
        with Session() as s:
            trainer, _, _ = s.start(cfg)
            s.catch_signals()
            assert all(signal.getsignal(x) is not mine for x in STOP_SIGNALS)
            s.open_run_dir([], 0.0)
            trainer.fit()
        assert all(signal.getsignal(x) is mine for x in STOP_SIGNALS)
        with pytest.raises(RuntimeError, match="an error inside"):
            with Session() as s:
                s.start(cfg)
                s.catch_signals()
                raise RuntimeError("an error inside")
        assert all(signal.getsignal(x) is mine for x in STOP_SIGNALS)
        files = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
        capsys.readouterr()
        with Session() as s:
            s.start(cfg)
            assert s.finished()
        assert capsys.readouterr().out.strip().endswith(
            "the run is already at step 2 (step_00000002), at or past train.steps=2: nothing to train, nothing "
            "written; raise --train.steps to continue it")
        assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == files
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
