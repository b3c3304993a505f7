"""Dry run: one rank of a large job, in one CPU process, with no memory and no network.

A fake process group of the requested world size stands in for NCCL (its collectives return at once), and the
trainer's own start-up (hybridpar.parallel.startup: meta-device build, the real parallelize function for one rank's
coordinates, then that rank's shards materialised and initialised on the CPU) runs for real; an AdamW step on zero
gradients of meta twins of the shards (one per distinct shape) creates the optimizer state (AdamW's, or Muon's
beside it, with this rank's Newton-Schulz FLOPs and all-to-all bytes). What comes out is that rank's local shard shapes
and bytes, the bytes it allocated and its init time: the figures the planner (hybridpar.planning.cost) must reproduce.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from hybridpar.config import Config
from hybridpar.errors import ConfigError
from hybridpar.parallel.distributed import MESH_AXES, init_mesh, local_tensor
from hybridpar.parallel.startup import build_parallel_model
from hybridpar.training.muon import muon_plan
from hybridpar.training.optim import make_optimizer, takes_muon


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding t's memory on this rank: a DTensor's local shard, an async collective's result."""
    t = local_tensor(t)
    return t.trigger_wait() if hasattr(t, "trigger_wait") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


_RANK_OF_MESH: dict[tuple, int] = {}


def dry_run(cfg: Config, world_size: int, rank: int = 0) -> dict:
    """Parallelize a resolved config's model (hybridpar.resolve: its degrees filled in) for `rank` of `world_size`
    on the meta device; returns its local bytes and shapes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it starts a fake one)")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside the world of {world_size}; pick 0 <= rank < {world_size}")
    degrees = (cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.tp)
    if math.prod(degrees) != world_size:
        raise ConfigError(f"the degrees {degrees} do not make a world of {world_size}; resolve the config first")
    cfg = replace(cfg, train=replace(cfg.train, compile=False))  # compile changes no shape, and needs real tensors
    start = time.perf_counter()
    # A device mesh compares equal to an earlier one of the same shape whatever its rank, and DTensor's caches then
    # hand back parameters on the earlier mesh, with that rank's coordinates (measured with torch 2.13): one rank
    # per mesh shape and process.
    if _RANK_OF_MESH.setdefault(degrees, rank) != rank:
        raise RuntimeError(f"this process ran the dry run of degrees {degrees} for rank {_RANK_OF_MESH[degrees]}; "
                           f"run rank {rank}'s in a new process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_mesh(degrees, torch.device("cpu"))
        init_start = time.perf_counter()
        # The trainer's own start-up: this rank's shards materialised on the CPU and initialised for real.
        model = build_parallel_model(cfg, mesh, torch.device("cpu"))
        init_seconds = time.perf_counter() - init_start
        params = dict(model.named_parameters())
        materialized = sum(_nbytes(p) for p in params.values())
        # The optimizer's state comes from a real step on zero gradients, taken on meta twins of the local shards
        # (the same shapes and dtypes; arithmetic on 10^8 zeros would change no figure), one twin per distinct
        # shard shape and optimizer (a parameter's state depends on these alone); FSDP2 keeps each gradient sharded
        # like its parameter.
        hidden = {n for n in params if takes_muon(n, cfg.optim)}
        kinds = Counter((tuple(_local(p).shape), p.dtype, n in hidden) for n, p in params.items())
        twins = {k: torch.empty(k[0], dtype=k[1], device="meta") for k in kinds}
        for t in twins.values():
            t.grad = torch.zeros_like(t)
        optimizer = make_optimizer([{"params": [t for k, t in twins.items() if not k[2]]}],
                                   [t for k, t in twins.items() if k[2]],
                                   replace(cfg.optim, fused=False, foreach=False))
        optimizer.step()
        state_bytes = {k: sum(_nbytes(v) for v in optimizer.state[t].values() if isinstance(v, torch.Tensor))
                       for k, t in twins.items()}
        muon = muon_plan([params[n] for n in params if n in hidden], cfg.optim.muon_ns_steps,
                         cfg.optim.muon_distribution == "gather") if hidden else {}
        out = {
            "world_size": world_size, "rank": rank, "degrees": dict(zip(MESH_AXES, degrees)),
            "coords": {axis: mesh[axis].get_local_rank() for axis in MESH_AXES},
            "dry_run_params_bytes": sum(_nbytes(p) for p in params.values()),
            "dry_run_materialized_bytes": materialized, "dry_run_init_seconds": init_seconds,
            "dry_run_grads_bytes": sum(n * _nbytes(twins[k].grad) for k, n in kinds.items()),
            "dry_run_optimizer_bytes": sum(n * state_bytes[k] for k, n in kinds.items()),
            "local_shapes": {n: tuple(_local(p).shape) for n, p in params.items()},
            **{f"dry_run_{k}": v for k, v in muon.items()},
        }
    finally:
        dist.destroy_process_group()
    out["dry_run_seconds"] = time.perf_counter() - start
    return out


def saved_activation_bytes(model: torch.nn.Module, input_ids: torch.Tensor, autocast: bool = False,
                           targets: torch.Tensor | None = None, loss: str = "fused", **kw) -> int:
    """Bytes autograd keeps for backward in one forward of a real (non-meta) model, each storage once, parameters
    excluded; with targets, through the loss: `fused` (the model's chunked LM head + loss) or `plain` (logits,
    then hybridpar's token_loss_sum); kw: the model's other arguments (context parallelism's positions). A
    checkpointed block shows up as the input it keeps, and a selectively checkpointed one also as the op outputs its
    policy cached (read from torch.utils.checkpoint's cache, whose forward contexts each checkpoint wrapper's, or
    each selectively checkpointed branch's, context_fn is wrapped to record for the call)."""
    from hybridpar.training.microbatch import chunked_loss, logits_loss

    params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    ctx = torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if autocast else nullcontext()
    contexts: list = []

    def recording(context_fn):
        def contexts_of_one_forward():
            forward, recompute = context_fn()
            contexts.append(forward)
            return forward, recompute
        contexts_of_one_forward.__wrapped__ = context_fn
        return contexts_of_one_forward

    wrappers = [m for m in model.modules() if "context_fn" in getattr(getattr(m, "checkpoint_fn", 0), "keywords", {})]
    for m in wrappers:
        m.checkpoint_fn = partial(m.checkpoint_fn, context_fn=recording(m.checkpoint_fn.keywords["context_fn"]))
    branches = [f for m in model.modules() for f in vars(m).values() if hasattr(f, "context_fn")]  # selective's
    for f in branches:
        f.context_fn = recording(f.context_fn)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
            if targets is None:
                out = model(input_ids, **kw)
            else:
                out = (chunked_loss if loss == "fused" else logits_loss)(model, input_ids, targets, **kw)
    finally:
        for m in wrappers:
            m.checkpoint_fn = m.checkpoint_fn.func
        for f in branches:
            f.context_fn = f.context_fn.__wrapped__
    # torch's caching mode: {op: calls}, the calls {call index: _VersionWrapper(tensor) or a marker} (torch 2.13)
    # or a list of _VersionWrapper (torch 2.6-2.11)
    for forward in contexts:
        for calls in forward.storage.values():
            for entry in (calls.values() if isinstance(calls, dict) else calls):
                for t in _tensors(entry):
                    pack(t)
    del out
    return sum(seen.values())


def _tensors(x):
    x = getattr(x, "val", x)  # torch.utils.checkpoint's _VersionWrapper around each cached output
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
