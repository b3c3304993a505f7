"""parallel.exact_reduction: gradients summed in an order-free way, so that a step's gradients are bitwise the same
for every data-parallel degree (tp held fixed).

A float sum depends on its order, and the order follows the layout: which microbatches a rank accumulates, then
FSDP's reduce-scatter and HSDP's all-reduce. Here every global microbatch's gradient is quantized on its own, before
any addition, to int64 on a grid per parameter that every layout shares, and the integers are summed (integer
addition is exact, so any order gives the same bits):

- the grid of a parameter is quantum = 2^(E - 52), 2^E the first power of two above CAP_GROWTH x the largest
  |microbatch gradient| of that parameter in the previous step (an all-reduced MAX: exact, so the same on every
  layout, and checkpointed with the run's position). Up to MAX_MICROBATCHES global microbatches of at most 2^E each
  sum below 2^62 quanta: no int64 overflow.
- A step whose largest |microbatch gradient| passes 2^E (the first step, and a jump of more than CAP_GROWTH) is
  replayed on the grid of what it measured; the decision reads an all-reduced MAX, so every rank and every layout
  takes it alike.
- Error bound: each microbatch's term is rounded once to the quantum, so an element of the summed gradient is off by
  at most M x quantum / 2 <= 2^(E - 43) for M <= 1024 microbatches, relative to the step's largest microbatch
  gradient at most 2^-35 x CAP_GROWTH = 2^-27: below fp32's own rounding of that largest term (2^-24), and the
  result is rounded to the gradient's dtype once.

Under FSDP2 the quantization happens in a custom reduce-scatter (FSDPModule.set_custom_reduce_scatter): every
microbatch is reduce-scattered as int64 into an accumulator this module owns (FSDP itself gets zeros), HSDP's
replicas add their accumulators with one int64 all-reduce per step, and the sharded gradients are written from it.
Without FSDP (one fp32 rank) each microbatch's .grad is quantized into the accumulator after its backward.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import _StridedShard

from hybridpar.parallel.distributed import local_tensor

QUANTUM_BITS = 52  # a term of at most 2^E is a multiple of 2^(E - 52): 53 bits, a double holds it exactly
MAX_MICROBATCHES = 1 << (62 - QUANTUM_BITS)  # 1,024 terms of 2^52 quanta stay below 2^62
CAP_GROWTH = 256.0  # a parameter's largest microbatch gradient may grow this much between steps without a replay


def quantum_of(bound: float) -> float:
    """The grid of a parameter whose previous largest |microbatch gradient| was `bound`."""
    _, e = math.frexp(bound * CAP_GROWTH)  # bound x CAP_GROWTH < 2^e
    return math.ldexp(1.0, e - QUANTUM_BITS)


def cap_of(bound: float) -> float:
    return quantum_of(bound) * 2.0 ** QUANTUM_BITS


def _quantize(g: torch.Tensor, quantum: torch.Tensor | float) -> torch.Tensor:
    return torch.round(g.double() / quantum).to(torch.int64)


class _IntReduceScatter(ReduceScatter):
    """One FSDP module's reduce-scatter: this rank's microbatch gradient (FSDP's flat input: per rank a row of every
    parameter's padded chunk) quantized per parameter, reduce-scattered as int64 into the accumulator, zeros to
    FSDP."""

    def __init__(self, owner: "ExactGradients", module: FSDPModule):
        self.owner, self.module = owner, module

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.owner._reduce_scatter(self.module, output_tensor, input_tensor, group)
        return None


# torch 2.13 deprecates reduce_scatter_tensor (a FutureWarning on every rank) for reduce_scatter_single, which
# older torch lacks
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

LOSS_GRID = 2.0 ** -32  # a microbatch's loss share, rounded to it: any sum of such float64 values below 2^21 is exact


class ExactGradients:
    """The mode for one model (hybridpar.training.reduction's interface): a step's integer accumulators and the
    largest |microbatch gradient| seen. The grids' bounds (one per parameter, in sorted name order) belong to the
    training loop's state: begin() takes them, finish() returns the next ones. Collective: every rank calls begin(),
    after_backward() and finish() alike. Every microbatch reduces on its own (sync leaves FSDP's flags as set here);
    the loss scale is 1 (the reduce-scatter sums)."""

    loss_dtype = torch.float64
    grad_scale = 1.0

    def __init__(self, model: nn.Module, mesh: DeviceMesh, names: dict[int, str]):
        self.mesh, self.names = mesh, names  # id(parameter) -> its plain name (the same on every layout)
        self.order = sorted(set(names.values()))
        self.modules: list[tuple[FSDPModule, list]] = []
        for m in model.modules():
            if isinstance(m, FSDPModule):
                group = m._get_fsdp_state()._fsdp_param_group
                if group is None or group.mesh_info.shard_mesh_size == 1:
                    continue  # (a shard group of one rank skips the reduce-scatter: its .grad is read as a plain one)
                m.set_custom_reduce_scatter(_IntReduceScatter(self, m))
                m.set_requires_all_reduce(False, recurse=False)  # (HSDP: the int64 all-reduce in finish())
                self.modules.append((m, group.fsdp_params))
        covered = {id(fp.sharded_param) for _, params in self.modules for fp in params}
        self.plain = [p for p in model.parameters() if id(p) not in covered]
        self.replicate = mesh["dp_replicate"] if mesh["dp_replicate"].size() > 1 else None
        self.device = local_tensor(next(model.parameters())).device
        self.replays = 0  # steps replayed on a coarser grid since this start (logged: exact_replays)

    # -- the step ---------------------------------------------------------------------------------------------
    def begin(self, bounds: list[float] | None) -> None:
        """A step (or its replay) on the grids of `bounds` (None: none measured yet, the step will be replayed)."""
        self.bounds = None if bounds is None else dict(zip(self.order, bounds))
        self.acc: dict[int, torch.Tensor] = {}
        self.seen: dict[str, torch.Tensor] = {}
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)

    def sync(self, model, i: int, n: int) -> None:
        pass

    def row(self) -> dict:
        return {"exact_replays": self.replays}

    def _note(self, name: str, g: torch.Tensor) -> None:
        """`g` (this rank's part of a microbatch gradient) into the largest |term| seen of parameter `name`."""
        g = local_tensor(g).detach()
        m = g.abs().amax().double() if g.numel() else torch.zeros((), dtype=torch.float64, device=g.device)
        self.seen[name] = torch.maximum(self.seen[name], m) if name in self.seen else m
        # (amax carries a NaN or an inf along: a device flag, no host read per parameter)
        self.nonfinite = self.nonfinite | ~torch.isfinite(m).to(self.nonfinite.device)

    def _quantum(self, name: str) -> float:
        return quantum_of(self.bounds[name]) if self.bounds is not None else 1.0

    def _reduce_scatter(self, module, output, flat, group) -> None:
        world = dist.get_world_size(group)
        rows = flat.view(world, -1)
        params = dict(self.modules)[module]
        sizes = [fp.padded_sharded_param_size.numel() for fp in params]
        if sum(sizes) != rows.shape[1]:
            raise RuntimeError("parallel.exact_reduction: an FSDP module reduced a gradient for only some of its "
                               "parameters; every parameter must take part in every step")
        q = torch.empty(rows.shape, dtype=torch.int64, device=flat.device)
        for fp, part, into in zip(params, rows.split(sizes, dim=1), q.split(sizes, dim=1)):
            name = self.names[id(fp.sharded_param)]
            self._note(name, part)
            into.copy_(_quantize(part, self._quantum(name)))  # (one parameter's float64 at a time)
        q = q.reshape(-1)
        out = torch.empty(rows.shape[1], dtype=torch.int64, device=flat.device)
        _reduce_scatter_single(out, q, group=group)
        key = id(module)
        self.acc[key] = self.acc[key] + out if key in self.acc else out
        output.zero_()

    @staticmethod
    def loss_share(share: torch.Tensor) -> torch.Tensor:
        """A microbatch's loss share as float64 on LOSS_GRID: its sums over microbatches and ranks, in any order, are
        exact (the logged loss and the spike test's are then the same on every layout)."""
        return torch.round(share.detach().double() / LOSS_GRID) * LOSS_GRID

    def after_backward(self) -> None:
        """After a microbatch's backward: the gradients of parameters outside FSDP into the accumulator."""
        for p in self.plain:
            if p.grad is None:
                continue
            if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                # A replicated parameter under tensor parallelism holds each tp rank's part of the sum: reduced now,
                # per microbatch, as FSDP reduces it before its reduce-scatter, so both paths quantize the same sum.
                p.grad = p.grad.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                                         for pl in p.grad.placements])
            name, local = self.names[id(p)], local_tensor(p.grad)
            self._note(name, local)
            q = _quantize(local, self._quantum(name))
            self.acc[id(p)] = self.acc[id(p)] + q if id(p) in self.acc else q
            local.zero_()  # (the next microbatch's backward adds to zeros: its own gradient, exactly)

    def finish(self) -> tuple[bool, list[float] | None]:
        """After the step's last microbatch: (False, the bounds this pass measured) when the step must be replayed
        on them (a term passed its grid; the gradients are cleared), else (True, the next step's bounds) with the
        gradients written (NaN where the step was not finite: it is then skipped, and the bounds stay)."""
        names, device = self.order, self.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        seen = torch.stack([self.seen[n].to(device) if n in self.seen else zero for n in names])
        both = torch.cat([seen, self.nonfinite.to(device).reshape(1).double()])
        if dist.is_initialized() and dist.get_world_size() > 1:  # (on the device: NCCL reduces no CPU tensor)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)  # exact: a MAX does not round
        both = both.cpu()  # the step's one host read of the mode
        seen, nonfinite = both[:-1].tolist(), bool(both[-1])
        over = self.bounds is None or any(s > cap_of(self.bounds[n]) for n, s in zip(names, seen))
        if over and not nonfinite:
            self._clear()
            self.replays += 1
            return False, seen
        if nonfinite:  # the step is skipped as non-finite (its gradients NaN); the grids stay
            self._write(lambda acc, quantum: torch.full(acc.shape, math.nan, dtype=torch.float64))
            return True, None if self.bounds is None else [self.bounds[n] for n in names]
        if self.replicate is not None:
            for acc in self.acc.values():
                dist.all_reduce(acc, group=self.replicate.get_group())  # int64: exact
        self._write(lambda acc, quantum: acc.double() * quantum)
        return True, seen

    def _clear(self) -> None:
        for p in self.plain:
            p.grad = None
        for _, params in self.modules:
            for fp in params:
                fp.sharded_param.grad = None

    def _write(self, value) -> None:
        for p in self.plain:
            if id(p) in self.acc:
                local_tensor(p.grad).copy_(value(self.acc[id(p)], self._quantum(self.names[id(p)])))
        for module, params in self.modules:
            acc, offset = self.acc.get(id(module)), 0
            for fp in params:
                n = fp.padded_sharded_param_size.numel()
                if acc is not None:
                    quantum = self._quantum(self.names[id(fp.sharded_param)])
                    grad = value(acc[offset:offset + n], quantum)[:math.prod(fp.sharded_size)]
                    grad = grad.view(fp.sharded_size).to(fp.sharded_param.dtype)
                    if fp.sharded_param.grad is None:  # (HSDP without FSDP's all-reduce leaves it unset)
                        fp.sharded_param.grad = fp.to_sharded_dtensor(grad)
                    else:
                        local_tensor(fp.sharded_param.grad).copy_(grad)
                offset += n

    def grad_norm(self, model: nn.Module) -> torch.Tensor:
        """The global L2 norm of the model's gradients, summed as integers: each square (exact in float64 for a
        float32 element) on a grid 2^(E - 62 + ceil(log2 n)) for n elements whose largest square is below 2^E, so the
        int64 sum cannot overflow and its error is below 2^-(61 - ceil(log2 n)) of the norm's square. A rank sums
        its own elements; a parameter held alike by k ranks (replicated over tp, or over HSDP's replicas) is summed
        k times over the world and divided by k, exactly."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        world = dist.get_world_size() if dist.is_initialized() else 1
        device = self.device  # (every collective here runs on it: NCCL reduces no CPU tensor)
        locals_, copies, count = [], [], 0.0
        for g in grads:
            locals_.append(local_tensor(g).detach())
            # (FSDP over a tensor-parallel dim shards with _StridedShard, which is_shard() does not count)
            shards = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements)
                               if pl.is_shard() or isinstance(pl, _StridedShard)) if hasattr(g, "placements") else 1
            copies.append(world // shards)
            count += locals_[-1].numel() * shards / world  # (each element counted once over the world)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        top = torch.stack([t.abs().amax().double() if t.numel() else zero for t in locals_] or [zero]).amax()
        count = torch.tensor([count], dtype=torch.float64, device=device)
        top = top.reshape(1)
        if world > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            dist.all_reduce(count)
        largest, n = float(top), max(1, round(float(count)))
        if not math.isfinite(largest):
            return torch.tensor(math.nan, device=device)
        _, e = math.frexp(largest * largest)  # largest^2 < 2^e
        grid = math.ldexp(1.0, e - 62 + math.ceil(math.log2(n)))
        kinds = sorted(set(copies))
        sums = torch.zeros(len(kinds), dtype=torch.int64, device=device)
        for t, k in zip(locals_, copies):  # (int64 on the device: no host read per parameter)
            sums[kinds.index(k)] += torch.round(t.double() ** 2 / grid).to(torch.int64).sum()
        if world > 1:
            dist.all_reduce(sums)  # int64: exact
        total = sum(int(s) // k for s, k in zip(sums.tolist(), kinds))
        return torch.tensor(math.sqrt(math.ldexp(float(total), 0) * grid), device=device).float()
