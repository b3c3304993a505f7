"""Sequence-parallel activations kept as shards (Korthikanti et al. 2022, as Megatron-LM does).

Under sequence parallelism a TP region's input arrives as this rank's sequence shard and is all-gathered before the
column-parallel projections (Q/K/V, the MLP's up and gate, the LM head). Autograd would keep that gathered input,
full sequence x H, for the projections' weight gradients. `keep_sequence_shard(module)` keeps the shard instead
(it is 1/tp of it) and all-gathers it again when backward first needs it, once per region: one more all-gather per
region and microbatch, the same numbers.

Mechanism: saved-tensor hooks around the module's forward. The gathered input is recognised by its storage and
saved as a handle to the shard; every other tensor is saved as is. Saved-tensor hooks do not stack, so enclosing
ones (a measurement of what autograd keeps, CPU offload) are called from these: they still see every saved tensor,
the shard in place of the gathered input.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

_same = (lambda t: t, lambda t: t)


def _storage(t: torch.Tensor) -> int | None:
    """The data pointer of t's (local) storage; None for a tensor-wrapper subclass (torchao's float8 tensors, which
    a fp8 linear saves instead of its input), which has none of its own."""
    local = t._local_tensor if isinstance(t, DTensor) else t  # the attribute, not to_local(): no autograd op here
    if is_traceable_wrapper_subclass(local):
        return None
    return local.untyped_storage().data_ptr()


class _Regather:
    """A saved gathered input, held as the shard it came from; all-gathered again on its first use in backward and
    dropped after its last."""

    def __init__(self, shard: DTensor, placements, outer):
        self.shard, self.placements, self.outer, self.full, self.uses = outer[0](shard), placements, outer, None, 0

    def get(self) -> DTensor:
        if self.full is None:
            with torch.no_grad():
                self.full = self.outer[1](self.shard).redistribute(placements=self.placements)
        full = self.full
        self.uses -= 1
        if self.uses == 0:
            self.full = self.shard = None
        return full


def keep_sequence_shard(module: nn.Module) -> None:
    """Make `module` (whose TP input hook all-gathers a sequence-sharded first argument) keep the shard for backward.
    Call after the module was parallelised: the shard is captured before the TP hook, the gathered input after."""
    state: dict = {}

    def capture_shard(_mod, args):
        state["shard"] = args[0]

    def enter(_mod, args):
        shard, gathered = state.pop("shard"), args[0]
        if not (torch.is_grad_enabled() and isinstance(shard, DTensor) and isinstance(gathered, DTensor)
                and shard.placements != gathered.placements):
            return  # evaluation, or nothing was gathered
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False) or _same  # enclosing hooks, if any
        ptr, handle = _storage(gathered), None

        def pack(t):
            # the gathered tensor itself or a contiguous reshape of it (a linear saves its input as a (tokens, H)
            # view); anything else sharing its storage is saved as is
            if (isinstance(t, DTensor) and _storage(t) == ptr and t.numel() == gathered.numel()
                    and t._local_tensor.is_contiguous()):
                nonlocal handle
                handle = handle or _Regather(shard, gathered.placements, outer)
                handle.uses += 1
                return handle, t.shape
            return outer[0](t)

        def unpack(x):
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], _Regather):
                return x[0].get().view(x[1])
            return outer[1](x)

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        state["hooks"] = hooks

    def leave(_mod, _args, _out):
        hooks = state.pop("hooks", None)
        if hooks is not None:
            hooks.__exit__(None, None, None)

    module.register_forward_pre_hook(capture_shard, prepend=True)
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)
