"""Tensor-parallel building blocks on 2 real gloo ranks: column/row-parallel linears against nn.Linear, the
loss-parallel cross entropy against F.cross_entropy, and FSDP2 accumulation skipping its gradient collectives on
non-final microbatches (counted by wrapping torch.distributed's reduce-scatter and all-gather entry points, which
still run the real collectives)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from warm import Results, spawn


def _worker(rank: int, world: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        from hybridpar.training.microbatch import forward_backward_no_pipelining
        from hybridpar.training.reduction import MeanReduction
        from hybridpar.models import build_model, get_model_config
        from hybridpar.parallel.fsdp import apply_fsdp
        from hybridpar.config import ParallelConfig
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        out = {}
        # 1. Column -> row parallel MLP equals the plain one, forward and backward.
        torch.manual_seed(0)
        ref = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        tp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        tp.load_state_dict(ref.state_dict())
        parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = torch.randn(4, 16)
        x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_ref, y_tp = ref(x_ref), tp(x_tp)
        y_ref.square().sum().backward()
        y_tp.square().sum().backward()
        out["mlp_out"] = (y_tp - y_ref).abs().max().item()
        out["mlp_dx"] = (x_tp.grad - x_ref.grad).abs().max().item()
        out["mlp_dw0"] = (tp[0].weight.grad.full_tensor() - ref[0].weight.grad).abs().max().item()
        out["mlp_dw2"] = (tp[2].weight.grad.full_tensor() - ref[2].weight.grad).abs().max().item()
        out["w0_local_shape"] = tuple(tp[0].weight.to_local().shape)

        # 2. Loss-parallel cross entropy on vocab-sharded logits equals F.cross_entropy.
        logits = torch.randn(6, 10, requires_grad=True)
        target = torch.tensor([1, 9, 0, 4, -100, 7])
        want = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        want.backward()
        dlogits = distribute_tensor(logits.detach().clone(), mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            got = F.cross_entropy(dlogits, target, ignore_index=-100, reduction="sum")
            got.backward()
        out["ce"] = abs(got.full_tensor().item() - want.item())
        out["ce_grad"] = (dlogits.grad.full_tensor() - logits.grad).abs().max().item()

        # 3. FSDP2 accumulation: no gradient collective on the first of two microbatches, for FSDP (dp_shard=2)
        # and for HSDP's replicate all-reduce (dp_replicate=2).
        xb = torch.randint(0, 4096, (1, 16))
        entry = {"reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
                 "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
                 "all_reduce": "all_reduce"}
        # FSDP2 reaches these through the torch.distributed module (the names changed across torch releases).
        real = {name: getattr(dist, name) for name in entry if hasattr(dist, name)}
        calls = {}

        def counting(name):
            def call(*a, **k):
                calls[entry[name]] += 1
                return real[name](*a, **k)
            return call

        for shape, key in (((1, world, 1, 1), "fsdp_counts"), ((world, 1, 1, 1), "hsdp_counts")):
            dp_mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
            model = build_model(get_model_config("tiny", n_layers=2), device="cpu")
            apply_fsdp(model, dp_mesh, ParallelConfig(), bf16=False)
            for name in real:
                setattr(dist, name, counting(name))
            counts = []
            try:  # 1 microbatch, then 2 accumulating unsharded, then 2 accumulating sharded
                for n, unsharded in ((1, True), (2, True), (2, False)):
                    calls.update(reduce_scatter=0, all_gather=0, all_reduce=0)
                    forward_backward_no_pipelining(model, [(xb, xb)] * n, 32, torch.device("cpu"),
                                                   reduction=MeanReduction(accumulate_unsharded=unsharded))
                    counts.append(dict(calls))
            finally:
                for name, fn in real.items():
                    setattr(dist, name, fn)
            out[key] = counts
        results[rank] = out
    finally:
        dist.destroy_process_group()


def test_tp_layers_loss_parallel_and_fsdp_accumulation(tmp_path):
    results = Results()
    spawn(_worker, args=(2, str(tmp_path / "init"), results), nprocs=2)
    for rank in range(2):
        r = results[rank]
        assert r["mlp_out"] < 1e-5 and r["mlp_dx"] < 1e-5 and r["mlp_dw0"] < 1e-5 and r["mlp_dw2"] < 1e-5, r
        assert r["w0_local_shape"] == (16, 16)  # each rank holds half of the output columns
        assert r["ce"] < 1e-4 and r["ce_grad"] < 1e-6, r
        one, two, sharded = r["fsdp_counts"]
        print("fsdp collective counts, 1 vs 2 microbatches (unsharded, sharded):", one, two, sharded)
        # accumulating sharded, each microbatch is a one-microbatch step: twice its gathers and reduce-scatters
        assert sharded["reduce_scatter"] == 2 * one["reduce_scatter"] and sharded["all_gather"] == 2 * one["all_gather"]
        # One microbatch: a reduce-scatter per FSDP group (2 blocks + root) ...
        assert one["reduce_scatter"] == 3, one
        # ... and two microbatches reduce-scatter exactly as often (only on the last one), and gather parameters
        # once more for the second forward (blocks reshard after forward) but not again for its backward.
        assert two["reduce_scatter"] == one["reduce_scatter"], (one, two)
        assert two["all_gather"] < 2 * one["all_gather"], (one, two)
        # HSDP with dp_replicate=2: gradients are all-reduced across replicas once per FSDP group, on the last
        # microbatch only.
        one, two, sharded = r["hsdp_counts"]
        print("hsdp collective counts, 1 vs 2 microbatches (unsharded, sharded):", one, two, sharded)
        assert one["all_reduce"] == 3, one
        assert two["all_reduce"] == 3, two
        assert sharded["all_reduce"] == 3, sharded  # sharded too: the replicas all-reduce on the last only


pytestmark = pytest.mark.multiprocess  # every test here starts processes
