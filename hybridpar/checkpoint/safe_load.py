"""Reading DCP checkpoints without running anything a file asks for.

DCP stores two kinds of pickles: the `.metadata` file (read by `pickle.load` in DCP's own reader) and, for non-tensor
values such as the optimizer's `param_groups`, byte entries inside the `.distcp` shards (read by
`torch.load(weights_only=False)` in DCP's default planner). Either would run code from a crafted checkpoint. Here:

- `.metadata` is read by `MetadataUnpickler`: an explicit set of (module, class name) pairs, compared as strings,
  never resolved through dots (protocol 4 resolves `"os.system"` attribute by attribute from an allowed module);
  the one function DCP pickles, torch's layout lookup, is replaced by a local table.
- the decoded metadata is then checked: only DCP's storage records, byte entries only under `optim.param_groups`,
  shard files named `__<rank>_<n>.distcp` inside the checkpoint (no paths), no storage transforms, every shard
  present and long enough for the ranges the index gives it, every tensor's chunks inside its size, backed by
  stored data and covering it (so no declared size is allocated that the files do not hold).
- byte entries are unpickled with `torch.load(weights_only=True)`: torch's own allow-list (numbers, strings,
  containers, tensors). Tensor entries already are (DCP's reader).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from hybridpar.errors import CheckpointError


_DCP_META = "torch.distributed.checkpoint.metadata"
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_DTYPES = {name for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
# Every global a DCP .metadata may name, by exact module and name: DCP's record classes and plain containers.
ALLOWED_GLOBALS = frozenset(
    {(_DCP_META, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                              "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), ("pathlib", "PosixPath"),
       ("pathlib", "PurePosixPath"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}
    # DCP's own plan records, which megatron-core's torch_dist saves keep in the metadata (all_local_plans)
    | {("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                             "TensorWriteData")}
    | {("torch", n) for n in _DTYPES})
_SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata, resolving only the names in ALLOWED_GLOBALS."""

    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED_GLOBALS:  # a dotted name is never in the set, so never walked
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                                         f"metadata: refusing to load it")
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _LAYOUTS.__getitem__  # "torch.strided" -> torch.strided, from a table built here
        return super().find_class(module, name)


def _hybridpar_bytes(key: str) -> bool:
    return key.startswith("optim.param_groups.")


def read_metadata(path: Path, byte_entries_ok=_hybridpar_bytes) -> Metadata:
    """The checked DCP metadata of checkpoint directory `path`; CheckpointError (one line) if it is unsafe or
    damaged. byte_entries_ok(key) says which keys may be byte entries (pickles); hybridpar writes them only for the
    optimizer's param_groups."""
    path = Path(path)
    meta_file = path / ".metadata"
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no .metadata file (deleted or never written): it cannot be "
                              f"loaded; use an earlier checkpoint of the run")
    _inside(path, meta_file)
    try:
        with open(meta_file, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{meta_file}: {e}") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as e:
        raise CheckpointError(f"{meta_file} is damaged ({type(e).__name__}: {e}); use an earlier checkpoint") from None
    _check_metadata(path, metadata, byte_entries_ok)
    return metadata


def _check_metadata(path: Path, md, byte_entries_ok=_hybridpar_bytes) -> None:
    bad = f"checkpoint {path}: .metadata"
    if type(md) is not Metadata or not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data,
                                                                                                    dict):
        raise CheckpointError(f"{bad} is not a DCP metadata record ({type(md).__name__}); refusing to load it")
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata) and byte_entries_ok(str(key)):
            continue
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"{bad} declares {key!r} as {type(entry).__name__}; hybridpar stores that as a "
                                  f"tensor: refusing to load it")
    stored = {(getattr(i, "fqn", None), tuple(getattr(i, "offset", ()) or ())): info
              for i, info in md.storage_data.items()}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_chunks(bad, key, entry, stored)
    needed: dict[str, int] = {}
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
            raise CheckpointError(f"{bad} points {getattr(index, 'fqn', index)!r} at {name!r}, not a shard file of "
                                  f"this checkpoint (__<rank>_<n>.distcp): refusing to load it")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{bad} asks for storage transforms {info.transform_descriptors!r}, which hybridpar "
                                  f"never writes: refusing to load it")
        if not all(isinstance(v, int) and v >= 0 for v in (info.offset, info.length)):
            raise CheckpointError(f"{bad} gives {index.fqn!r} the range offset={info.offset!r} length={info.length!r}")
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = path / name
        _inside(path, shard)
        if not shard.is_file():
            raise CheckpointError(f"checkpoint {path} is missing its shard {name} (deleted or never written): it "
                                  f"cannot be loaded; use an earlier checkpoint of the run")
        size = shard.stat().st_size
        if size < end:
            raise CheckpointError(f"checkpoint {path}: shard {name} is truncated ({size} bytes, its index needs "
                                  f"{end}); use an earlier checkpoint of the run")


def _inside(path: Path, f: Path) -> None:
    """A checkpoint's file is read only where it is: a link out of the checkpoint directory is refused."""
    if f.is_symlink() and not f.resolve().is_relative_to(path.resolve()):
        raise CheckpointError(f"checkpoint {path}: {f.name} is a link out of the checkpoint (to {f.resolve()}): "
                              f"refusing to read it; copy the file in instead")


def _check_chunks(bad: str, key: str, entry, stored: dict) -> None:
    """A tensor's chunks lie inside its size, each has stored data at least as long as its elements, and together
    they hold every element: a size the data does not back (a loader would allocate it whole) is refused."""
    size, item = tuple(entry.size), entry.properties.dtype.itemsize
    held = 0
    for c in entry.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o < 0 or n < 0 or o + n > whole for o, n, whole in zip(offsets, sizes, size)):
            raise CheckpointError(f"{bad} gives {key!r} a chunk of {sizes} at {offsets}, outside its size {size}: "
                                  f"refusing to load it")
        info, need = stored.get((key, offsets)), math.prod(sizes) * item
        if info is None or not isinstance(info.length, int) or info.length < need:
            raise CheckpointError(f"{bad} declares {key!r}'s chunk at {offsets} as {need:,} bytes, but its stored "
                                  f"data is {getattr(info, 'length', 0)!r} bytes: refusing to load it")
        held += math.prod(sizes)
    if held < math.prod(size):
        raise CheckpointError(f"{bad} declares {key!r} of size {size} ({math.prod(size):,} elements), but its chunks "
                              f"hold {held:,}: refusing to load it")


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read and checked by read_metadata() instead of pickle.load (or taken as
    already read and checked, so a load unpickles it once)."""

    def __init__(self, path, metadata: Metadata | None = None):
        super().__init__(path)
        self._checked = metadata

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except (RuntimeError, EOFError, pickle.UnpicklingError) as e:  # torch.load of a damaged chunk
            if isinstance(e, RuntimeError) and "PytorchStreamReader" not in str(e):
                raise
            why = "not a tensor record" if isinstance(e, pickle.UnpicklingError) else "a damaged record"
            raise CheckpointError(f"checkpoint {self.path}: a shard's data cannot be read ({why}); the file is "
                                  f"damaged: use an earlier checkpoint of the run") from None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            raise CheckpointError(f"{self.path}: per-rank metadata files are not written by hybridpar")
        metadata = self._checked if self._checked is not None else read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class InertRecord:
    """What a class named in a plain-data file becomes when hybridpar needs none of its behaviour (Megatron-LM's enums
    and small config objects inside its saved `args`): the arguments are kept, nothing of the file's runs."""

    args: tuple = ()
    state = None

    def __init__(self, *args):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"InertRecord{self.args!r}"


# The classes, by full name, that Megatron-LM's saved `args` (and Transformer Engine's extra state in legacy saves)
# hold; each is read as an InertRecord. Nothing outside this list is accepted, whatever its module.
INERT_CLASSES = frozenset({
    "megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.CudaGraphModule", "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.LayerType", "megatron.core.enums.ModelType",
    "megatron.core.transformer.pipeline_parallel_layer_layout.PipelineParallelLayerLayout",
    "_io.BytesIO", "io.BytesIO"})


def load_plain_torch_file(path: Path):
    """A torch.save file (Megatron-LM's common.pt, model_optim_rng.pt) read with torch's weights-only unpickler: its
    allow-list plus argparse.Namespace, with the classes named in INERT_CLASSES replaced by InertRecord. Any other
    global is refused with one line; nothing named by the file is called."""
    import argparse

    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as e:  # a truncated or non-zip file
        raise CheckpointError(f"{path} cannot be read as a torch.save file ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else 'damaged'})") from None
    allowed = []
    for name in names:
        if name == "argparse.Namespace":
            allowed.append(argparse.Namespace)
        elif name in INERT_CLASSES:
            allowed.append((InertRecord, name))
        else:
            raise CheckpointError(f"{path} refers to {name}, which is not plain data (nor one of the Megatron-LM "
                                  f"classes hybridpar reads inertly): refusing to load it")
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} cannot be loaded as plain data ({first})") from None


def _load_bytes_safely(value: io.BytesIO, key: str):
    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else "not plain data"
        raise CheckpointError(f"byte entry {key!r} is not plain data ({first}); refusing to load it") from None


class _SafeBytes:
    """Byte entries unpickled with torch's weights-only allow-list, stored where DCP's planner would store them."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = _load_bytes_safely(value, read_item.dest_index.fqn)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's load planner with safe byte entries."""


class SafeEmptyLoadPlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Loads every entry a checkpoint holds (under `keys`) into an empty state dict, with safe byte entries."""


def exceptions_in(e: BaseException) -> list[BaseException]:
    """`e` and, for DCP's CheckpointException, each rank's exception inside it (with their causes)."""
    found, todo = [], [e]
    while todo:
        x = todo.pop()
        found.append(x)
        for failure in getattr(x, "failures", {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        if x.__cause__ is not None:
            todo.append(x.__cause__)
    return found


def unwrap_checkpoint_exception(e: BaseException) -> BaseException:
    """DCP wraps each rank's exception in a CheckpointException (a multi-line traceback): the first of our own
    CheckpointErrors inside it, else `e` itself."""
    return next((x for x in exceptions_in(e) if isinstance(x, CheckpointError)), e)


def plain_tensors(state):
    """`state` with every tensor-wrapper subclass (torchao's float8 all-gather weight, and the optimizer states
    made like it) replaced by the plain tensor it wraps, inside DTensors too, sharing storage: what is saved is
    ordinary tensors (whose reads the safe loader allows), and what is loaded lands in the wrapped storage."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def unwrap(t):
        if isinstance(t, DTensor):
            local = t.to_local()
            if is_traceable_wrapper_subclass(local):
                return DTensor.from_local(unwrap(local), t.device_mesh, t.placements, run_check=False,
                                          shape=t.shape, stride=t.stride())
            return t
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            return getattr(t, t.__tensor_flatten__()[0][0])
        return t

    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_tensors(v) for v in state]
    return unwrap(state)
