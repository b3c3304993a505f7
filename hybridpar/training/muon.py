"""Muon for the blocks' hidden matrices, AdamW for everything else, in one optimizer, distributed exactly.

Per hidden matrix W (wq, wk, wv, wo, gate, up, down of every block, each its own matrix) with gradient G:
    B <- momentum * B + (1 - momentum) * G                       (one fp32 buffer, sharded like W)
    U <- (1 - momentum) * G + momentum * B  (Nesterov), else B
    O <- NS_k(U): k quintic Newton-Schulz steps (a, b, c) = (3.4445, -4.7750, 2.0315) on U / ||U||_F, run on the
         shorter side (U^T when rows > cols), in bf16 for bf16 runs and fp32 for fp32 runs
    W <- W (1 - lr * weight_decay) - lr * s * O,   s = 0.2 sqrt(max(rows, cols)) (match_rms_adamw: the RMS of an
         AdamW update, so AdamW's lr carries over) or sqrt(max(1, rows / cols)) (original)
These are torch.optim.Muon's formulas (its test is the single-process reference).

Distribution. O is a function of the whole logical matrix U, never of a TP or FSDP shard of it, so the update is
the same for every layout. A matrix's shard group is the ranks that hold its other parts (its mesh, less the dims
it is replicated over: HSDP replicas each do the same work). Matrix j of the group's list (the model's parameter
order) is owned by member j mod n. With distribution=owner each step issues two all-to-alls per group: every rank
sends each owner its shard of that owner's matrices; the owner assembles them, orthogonalises, and sends each rank
its shard of the result back. distribution=gather all-gathers every matrix on every rank instead (n times the
Newton-Schulz work and traffic; simple, for small models).
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridpar.parallel.distributed import local_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
HIDDEN_MATRIX = re.compile(r"layers\.\d+\.(attn\.w[qkvo]|mlp\.(gate|up|down))\.weight")


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz approximation of U's orthogonal factor (singular values pushed into ~[0.7, 1.2])."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T  # (short, short)
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def update_scale(shape: tuple[int, int], rule: str) -> float:
    rows, cols = shape
    return 0.2 * math.sqrt(max(rows, cols)) if rule == "match_rms_adamw" else math.sqrt(max(1.0, rows / cols))


def ns_flops(shape: tuple[int, int], steps: int) -> int:
    """Multiply-adds x 2 of NS_k on a rows x cols matrix: per step X X^T (2 m^2 n), the Gram polynomial (2 m^3) and
    its product with X (2 m^2 n), m the shorter side."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)


def shard_group(p: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(global ranks holding parts of p, in mesh order, this rank's index among them); computed, no collective."""
    if not isinstance(p, DTensor):
        return (dist.get_rank() if dist.is_initialized() else 0,), 0
    coord = p.device_mesh.get_coordinate()
    grid = p.device_mesh.mesh
    index = tuple(coord[d] if pl.is_replicate() else slice(None) for d, pl in enumerate(p.placements))
    ranks = tuple(grid[index].flatten().tolist())
    return ranks, ranks.index(dist.get_rank())


def _all_groups(p: DTensor) -> list[tuple[int, ...]]:
    """Every shard group of p's mesh and placements (new_group must be called for all of them, on every rank)."""
    grid = p.device_mesh.mesh
    rep = [d for d, pl in enumerate(p.placements) if pl.is_replicate()]
    rest = [d for d in range(grid.ndim) if d not in rep]
    rows = grid.permute(*rep, *rest).reshape(math.prod(grid.shape[d] for d in rep), -1)
    return [tuple(r.tolist()) for r in rows]


def block_of(p: torch.Tensor) -> tuple[int, int, int, int]:
    """(row, col, rows, cols) of this rank's rectangle of p (a hidden matrix: TP and FSDP cut it into blocks)."""
    if not isinstance(p, DTensor):
        return (0, 0, *p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return (*offset, *shape)


def owner_share(shapes: list[tuple[int, int]], mine: list[int], n: int, k: int, steps: int,
                gather: bool = False) -> dict:
    """Member k's share of one step, for matrices of global `shapes` (in order) of which it holds `mine` elements
    each in a shard group of n: the Newton-Schulz FLOPs of the matrices it owns (j mod n == k) and the bytes it
    sends over the two all-to-alls (as many as it receives): its shard of every other owner's matrix out, then the
    others' blocks of its results. gather: every matrix is its own, and the bytes are those it receives."""
    flops = traffic = 0
    for j, (shape, held) in enumerate(zip(shapes, mine)):
        if gather or j % n == k:
            flops += ns_flops(shape, steps)
            traffic += math.prod(shape) - held
        else:
            traffic += held
    return {"muon_ns_flops": flops, "muon_comm_bytes": 4 * traffic}


def muon_plan(matrices: list[torch.Tensor], steps: int, gather: bool = False) -> dict:
    """owner_share of this rank, read from the parallelised matrices themselves (one shard group)."""
    groups = {shard_group(p) for p in matrices}
    assert len(groups) == 1, groups
    (ranks, k), = groups
    mine = [local_tensor(p).numel() for p in matrices]
    return owner_share([tuple(p.shape) for p in matrices], mine, len(ranks), k, steps, gather)


class Muon(torch.optim.Optimizer):
    """Muon for `matrices` (one param group, in the model's order) and `adamw` (its own groups) in one optimizer:
    one param_groups list (Muon's first, each group marked "muon"), one state dict, so DCP saves, reshards and
    restores both. `found_inf` (a 0-dim tensor set before step(), as for the fused AdamW) skips the whole update
    on the device when nonzero."""

    def __init__(self, matrices: list[torch.Tensor], adamw: torch.optim.AdamW, lr: float, weight_decay: float,
                 momentum: float, nesterov: bool, ns_steps: int, scale: str, ns_dtype: torch.dtype,
                 distribution: str):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        scale=scale, muon=True)
        super().__init__([{"params": matrices}], defaults)
        self.adamw, self.ns_dtype, self.distribution = adamw, ns_dtype, distribution
        for g in adamw.param_groups:
            g["muon"] = False
        self.param_groups += adamw.param_groups
        self._link()
        # Where each matrix lives, fixed for the optimizer's life: (its shard group's ranks, this rank's block).
        self._place = {p: (shard_group(p)[0], block_of(p)) for p in matrices}
        self._groups: dict[tuple, tuple] = {}  # shard group ranks -> (process group, every member's blocks)

    def _link(self) -> None:
        self.adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
        self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            self.adamw.found_inf = found_inf
        self.adamw.step()
        keep = None if found_inf is None else found_inf == 0
        for group in self.param_groups:
            if not group["muon"]:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            mu = group["momentum"]
            updates = []
            for p in params:
                g = local_tensor(p.grad)
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buf = local_tensor(buf)
                new = buf.lerp(g, 1 - mu) if keep is not None else buf.lerp_(g, 1 - mu)
                updates.append(g.lerp(new, mu) if group["nesterov"] else new)
                if keep is not None:
                    buf.copy_(torch.where(keep, new, buf))
            for p, o in zip(params, self._orthogonalise(params, updates, group["ns_steps"])):
                w = local_tensor(p)
                lr = group["lr"]
                step = -lr * update_scale(tuple(p.shape), group["scale"])
                if keep is None:
                    w.mul_(1 - lr * group["weight_decay"]).add_(o, alpha=step)
                else:
                    w.copy_(torch.where(keep, (w * (1 - lr * group["weight_decay"])).add_(o, alpha=step), w))

    def _orthogonalise(self, params: list[torch.Tensor], updates: list[torch.Tensor], steps: int):
        """NS_k of each parameter's whole update, returned as this rank's shard of it."""
        out: list = [None] * len(params)
        by_group: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):
            by_group.setdefault(self._place[p][0], []).append(i)
        for ranks, items in by_group.items():
            if len(ranks) == 1:  # this rank holds the whole matrix (one process, or replicated)
                for i in items:
                    out[i] = newton_schulz(updates[i].view(params[i].shape), steps, self.ns_dtype)
            elif self.distribution == "gather":
                for i in items:
                    p = params[i]
                    full = DTensor.from_local(updates[i], p.device_mesh, p.placements, shape=p.shape,
                                              stride=p.stride()).full_tensor()
                    r, c, h, w = self._place[p][1]
                    out[i] = newton_schulz(full, steps, self.ns_dtype)[r:r + h, c:c + w]
            else:
                for i, o in zip(items, self._owner_step(ranks, [params[i] for i in items],
                                                       [updates[i] for i in items], steps)):
                    out[i] = o
        return out

    def _setup(self, ranks: tuple, params: list[torch.Tensor]) -> tuple:
        """The process group of `ranks` (every group of this mesh created alike on every rank) and each member's
        block of each parameter (one all-gather, once)."""
        if ranks not in self._groups:
            mine = None
            # new_group is collective over the world, and p's mesh may be a part of it (tp alone beside data
            # replicas, parallel.exact_reduction's plain data parallelism): every rank creates every rank's groups.
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, _all_groups(params[0]))
            for group_ranks in sorted({g for groups in every for g in groups}):
                pg = dist.new_group(list(group_ranks))
                if group_ranks == ranks:
                    mine = pg
            blocks = torch.tensor([self._place[p][1] for p in params], dtype=torch.int64,
                                  device=params[0].device)  # (matrices, 4)
            gathered = [torch.empty_like(blocks) for _ in ranks]
            dist.all_gather(gathered, blocks, group=mine)
            self._groups[ranks] = (mine, torch.stack(gathered, 1).tolist())  # [matrix][member] -> block
        return self._groups[ranks]

    def _owner_step(self, ranks: tuple, params: list[torch.Tensor], updates: list[torch.Tensor], steps: int):
        pg, blocks = self._setup(ranks, params)
        n, me = len(ranks), ranks.index(dist.get_rank())
        owned = [j for j in range(len(params)) if j % n == me]
        size = lambda j, s: blocks[j][s][2] * blocks[j][s][3]  # noqa: E731 (member s's block of matrix j)
        # 1. Each member sends owner s its blocks of the matrices s owns; this rank receives its matrices' blocks.
        sent = [[updates[j].reshape(-1) for j in range(len(params)) if j % n == s] for s in range(n)]
        send_sizes = [sum(t.numel() for t in ts) for ts in sent]
        recv_sizes = [sum(size(j, s) for j in owned) for s in range(n)]
        got = self._exchange([t for ts in sent for t in ts], send_sizes, recv_sizes, pg, updates[0])
        results = {j: updates[0].new_empty(tuple(params[j].shape)) for j in owned}
        for s, piece in enumerate(got.split(recv_sizes)):
            for j, part in zip(owned, piece.split([size(j, s) for j in owned])):
                r, c, h, w = blocks[j][s]
                results[j][r:r + h, c:c + w] = part.view(h, w)
        # 2. Orthogonalise the owned matrices, then send each member its block of each.
        for j in owned:
            results[j] = newton_schulz(results[j], steps, self.ns_dtype).to(updates[0].dtype)
        back = [results[j][r:r + h, c:c + w].reshape(-1) for s in range(n) for j in owned
                for r, c, h, w in [blocks[j][s]]]
        got = self._exchange(back, recv_sizes, send_sizes, pg, updates[0])
        mine: dict[int, torch.Tensor] = {}
        for s, piece in enumerate(got.split(send_sizes)):
            js = [j for j in range(len(params)) if j % n == s]
            for j, part in zip(js, piece.split([updates[j].numel() for j in js])):
                mine[j] = part.view(updates[j].shape)
        return [mine[j] for j in range(len(params))]

    @staticmethod
    def _exchange(parts, send_sizes, recv_sizes, pg, like):
        flat = torch.cat(parts) if parts else like.new_empty(0)
        out = like.new_empty(sum(recv_sizes))
        dist.all_to_all_single(out, flat, recv_sizes, send_sizes, group=pg)
        return out
