"""Mixture-of-experts blocks on the mesh: expert parallelism, tensor parallelism's token shards, and the FSDP units of
the experts (applied from outside models/moe.py, like the other styles).

Expert parallelism (parallel.ep): the dp_shard x cp ranks of a replica are cut into groups of ep; the ranks of a group
hold E/ep experts each (the experts' stacked weights are DTensors, Shard(0) over the group) and exchange tokens with
two all_to_all_single calls per MoE forward: each rank sends every routed token slot to the rank holding its expert
and gets the outputs back (backward: the same two, reversed). The split sizes must be on the host: each rank sends
its per-expert counts to the group (one all_to_all_single of E integers) and reads the answer, the one host sync
of a dropless MoE block (one per block and forward; the planner and docs/moe.md count them).

The expert mesh: (dp_replicate, efsdp, ep) over the same ranks as the main mesh. ep groups lie inside dp_shard x cp
(rank (r, u, t) with u = g x ep + e: ep index e, group g); efsdp = (dp_shard x cp / ep) x tp indexes the ranks that
hold the same experts (g x tp + t). FSDP shards the experts over efsdp (HSDP: replicated over dp_replicate), the
router and the shared expert over dp_shard x cp x tp ("edp": every rank of a replica), each its own FSDP unit inside the
block's (one unit around a whole MoE block would put an FSDP collective between the two backward all-to-alls).

Tensor parallelism: the experts are not split by tp. An MoE block takes its tp rank's share of the tokens (the
sequence shard under sequence parallelism, or a slice of the replicated input), routes and computes them, and gives
the output back in the residual stream's layout (an all-gather without sequence parallelism). The ranks of one tp
group then hold different tokens: the router, shared expert and experts sum their gradients over tp too, hence the
edp and efsdp meshes above include tp. A sequence cut over cp and tp ranks has its balance counts summed over them
(MoE.sequence_sum) and its router losses' values too (GPT.moe_loss_sum), so every layout sees the same per-sequence
statistics.

Gradient scale: the loss is scaled by the dense FSDP mesh's size R x S x C (hybridpar.training.reduction), which the
dense units' average undoes; the MoE units average over their own meshes, and their reduced gradients are multiplied
by (their mesh's size) / (R x S x C) (scale_moe_grads). (FSDP2's own divide factor is not used: on a one-rank mesh
with sum reduction torch 2.13 divides twice.)
"""

from __future__ import annotations

import warnings
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInputOutput, parallelize_module

from hybridpar.errors import ConfigError
from hybridpar.models.moe import Experts


def check_moe(cfg, layout, seq_lens: list[int]) -> None:
    """parallel.ep's and a mixture of experts' layout rules, one line each (hybridpar.resolve, before any model)."""
    m, ep = cfg.model, cfg.parallel.ep
    if not m.n_experts:
        if ep > 1:
            raise ConfigError(f"parallel.ep={ep} splits the experts of a mixture of experts, but model.n_experts=0 "
                              f"(a dense model); drop --parallel.ep or pick an MoE model")
        return
    if m.n_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide model.n_experts={m.n_experts} (each ep rank holds "
                          f"n_experts / ep experts); pick ep among its divisors")
    if layout.fsdp % ep:
        raise ConfigError(f"parallel.ep={ep} must divide the dp_shard x cp = {layout.dp_shard} x {layout.cp} ranks "
                          f"an ep group is taken from; pick ep dividing {layout.fsdp}")
    if layout.tp > 1:
        for seq in seq_lens:
            if (seq // layout.cp) % layout.tp:
                raise ConfigError(f"parallel.tp={layout.tp}: an MoE block computes each tp rank's share of the "
                                  f"{seq // layout.cp} tokens of a sequence (train.seq_len={seq} / cp {layout.cp}); "
                                  f"use a sequence length divisible by {layout.cp * layout.tp}")
    refused = {"train.fp8": cfg.train.fp8 != "off", "optim.name muon": cfg.optim.name == "muon",
               "train.compile": cfg.train.compile, "parallel.exact_reduction": cfg.parallel.exact_reduction,
               "parallel.layout auto": cfg.parallel.layout == "auto"}
    bad = [name for name, on in refused.items() if on]
    if bad:
        raise ConfigError(f"model.n_experts={m.n_experts}: a mixture of experts does not run with {', '.join(bad)} "
                          f"yet; leave {'it' if len(bad) == 1 else 'them'} off for an MoE model")


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The (dp_replicate, efsdp, ep) mesh of the main mesh's ranks (see the module's docstring). Every axis lists its
    ranks in increasing order, as a process group numbers them (a mesh whose coordinates disagreed with its groups'
    rank order would put FSDP's shards in the wrong places)."""
    R, S, C, T = (mesh[a].size() for a in ("dp_replicate", "dp_shard", "cp", "tp"))
    D = S * C
    # rank ((r D + g ep + e) T + t), for group g, ep index e and tp rank t, sits at [r, g T + t, e]
    ranks = torch.arange(R * D * T).reshape(R, D // ep, ep, T).transpose(2, 3).reshape(R, -1, ep)
    return DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("dp_replicate", "efsdp", "ep"))


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """(dp_replicate,) "edp": every rank of a replica on one axis (dp_shard x cp x tp flattened), the router's and the
    shared expert's FSDP mesh (their tp ranks hold different tokens)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        mesh["dp_shard", "cp", "tp"]._flatten("edp")
        return mesh["dp_replicate", "edp"] if mesh["dp_replicate"].size() > 1 else mesh["edp"]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class ParallelExperts(Experts):
    """Experts whose stacked weights are Shard(0) over an ep group: forward dispatches the token slots (sorted by
    global expert) to the ranks holding their experts and combines the outputs back, in the same order."""

    group = None
    ep = 1

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, E = self.ep, counts.numel()
        mine = E // ep
        theirs = torch.empty_like(counts)
        dist.all_to_all_single(theirs, counts, group=self.group)  # theirs[j * mine + l]: rank j's slots for my l
        sent, got = torch.stack([counts, theirs]).view(2, ep, mine).tolist()  # (the host sync)
        send = [sum(c) for c in sent]
        recv = [sum(c) for c in got]
        rows = _AllToAll.apply(x, recv, send, self.group)  # by source rank, then by expert
        # regroup by local expert: expert l's rows from rank 0, then rank 1, ... (the rows arrive by rank, then expert)
        flat = [c for row in got for c in row]
        starts = [0, *accumulate(flat)]
        blocks = [(starts[j * mine + l], got[j][l]) for l in range(mine) for j in range(ep)]
        perm = torch.cat([torch.arange(b, b + n) for b, n in blocks]).to(x.device)
        sizes = [sum(got[j][l] for j in range(ep)) for l in range(mine)]
        w = [p.to_local() if isinstance(p, DTensor) else p for p in (self.w_gate, self.w_up, self.w_down)]
        y = self.compute(rows[perm], sizes, *w)
        y = y[perm.argsort()]  # back in arrival order
        return _AllToAll.apply(y, send, recv, self.group)


def _sum_over(group):
    def total(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t
    return total


def apply_moe(model: nn.Module, mesh: DeviceMesh, ep: int, sequence_parallel: bool) -> DeviceMesh | None:
    """The MoE blocks of `model` (on the meta device) on the mesh, in place: tp token shards, sequence statistics
    summed over the cp x tp ranks of a sequence, experts Shard(0) over ep groups. Returns the expert mesh (None for a
    dense model)."""
    blocks = model.moe_blocks()
    if not blocks:
        return None
    tp, cp = mesh["tp"].size(), mesh["cp"].size()
    emesh = expert_mesh(mesh, ep)
    pieces = [mesh[a] for a in ("cp", "tp") if mesh[a].size() > 1]
    seq_group = None
    if len(pieces) == 2:
        seq_group = mesh["cp", "tp"]._flatten("cp_tp").get_group()
    elif pieces:
        seq_group = pieces[0].get_group()
    if tp > 1:
        model.moe_loss_sum = _sum_over(mesh["tp"].get_group())
    seq = Shard(1) if sequence_parallel else Replicate()
    for moe in blocks:
        moe.sequence_pieces = cp * tp
        moe.sequence_sum = _sum_over(seq_group) if seq_group is not None else None
        if tp > 1:  # this tp rank's tokens in, the residual stream's layout out
            parallelize_module(moe, mesh["tp"], PrepareModuleInputOutput(
                input_layouts=(seq,), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(seq,), use_local_output=True))
        if ep > 1:
            ex = moe.experts
            ex.__class__ = ParallelExperts
            ex.group, ex.ep = emesh["ep"].get_group(), ep
            for name in ("w_gate", "w_up", "w_down"):
                p = getattr(ex, name)
                setattr(ex, name, nn.Parameter(distribute_tensor(p.data, emesh["ep"], [Shard(0)]),
                                               requires_grad=p.requires_grad))
    return emesh


def apply_moe_fsdp(model: nn.Module, mesh: DeviceMesh, emesh: DeviceMesh, dense_dp: int, **fsdp_kw) -> None:
    """Each MoE block's experts on (dp_replicate, efsdp), its router and shared expert on (dp_replicate, edp): their
    own FSDP units (the block's unit then holds the rest). FSDP averages over each unit's mesh; the gradients
    want the sum divided by the dense units' dense_dp ranks, so grad_factors (the reduction applies them once the
    step's gradients are reduced) hold (parameters, unit mesh size / dense_dp)."""
    from torch.distributed.fsdp import fully_shard

    rep = emesh["dp_replicate"].size() > 1
    experts_mesh = emesh["dp_replicate", "efsdp"] if rep else emesh["efsdp"]
    dense_mesh = replica_mesh(mesh)
    factors = []
    for moe in model.moe_blocks():
        units = [(moe.experts, experts_mesh), (moe.router, dense_mesh)]
        if moe.shared is not None:
            units.append((moe.shared, dense_mesh))
        for module, m in units:
            fully_shard(module, mesh=m, **fsdp_kw)
            if m.size() != dense_dp:
                factors.append((list(module.parameters()), m.size() / dense_dp))
    model.moe_grad_factors = factors


@torch.no_grad()
def scale_moe_grads(model: nn.Module) -> None:
    """Multiply the MoE units' reduced gradients by their factors (apply_moe_fsdp)."""
    for params, factor in getattr(model, "moe_grad_factors", ()):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)
