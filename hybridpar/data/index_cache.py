"""megatron-core's index caches, checked before it reads them: nothing read from data.cache_dir may run code.

megatron-core (0.16) keeps GPTDataset's document, sample and shuffle indexes and BlendedDataset's dataset indexes as
.npy files under the cache directory (shared by every node), and reads them with `numpy.load(allow_pickle=True)`:
numpy unpickles any file that is not an .npy array (or an .npy array of Python objects), so a file put there would
run its code on every rank. Two guards, each enough for a pickle:
- before megatron-core opens a cache directory, every index file in it is checked to be a plain .npy array of the
  integer type and rank megatron-core writes, whose header agrees with the file's size (`check_index_files`);
  after it opened them, their values are checked to index what they index (`check_index_values`): a damaged cache
  is refused in one line naming the file, not an IndexError deep inside megatron-core, nor wrong samples;
- megatron-core's dataset modules see a numpy whose load() never unpickles (`no_pickle_numpy`), so a file replaced
  between the check and the read fails to load instead of running.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hybridpar.errors import DataError

_I16, _I32, _I64, _U32 = (np.dtype(t) for t in (np.int16, np.int32, np.int64, np.uint32))
# file-name suffix -> (dtypes megatron-core 0.16 writes, array rank)
INDEX_FILES = {
    "-document_index.npy": ({_I32}, 1),
    "-sample_index.npy": ({_I32, _I64}, 2),  # (samples + 1, 2): document position and token offset
    "-shuffle_index.npy": ({_U32, _I64}, 1),
    "-dataset_sample_index.npy": ({_I64}, 1),
    "-dataset_index.npy": ({_I16}, 1),
}


FIX = "delete it (it is rebuilt at the next start) and check who else writes to data.cache_dir"


def npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, bytes of header) of an .npy file, read without unpickling anything (numpy's header parser
    evaluates literals only); DataError when the file is no .npy array."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
            shape, _, dtype = read(f)  # (shape, fortran order, dtype)
            return dtype, tuple(shape), f.tell()
    except (ValueError, KeyError, OSError, SyntaxError) as e:
        raise DataError(f"index cache {path} is not an .npy array ({str(e) or type(e).__name__}): {FIX}") \
            from None


def check_index_files(directory: Path) -> None:
    """Every megatron-core index file in `directory` (one blend's cache) is a plain integer .npy array of the type
    and rank megatron-core writes, its size what its header says. DataError naming the first that is not."""
    if not directory.is_dir():
        return
    for path in sorted(directory.iterdir()):
        suffix = next((s for s in INDEX_FILES if path.name.endswith(s)), None)
        if suffix is None:
            continue
        if not path.is_file():
            raise DataError(f"index cache {path} is not a regular file: {FIX}")
        dtypes, ndim = INDEX_FILES[suffix]
        dtype, shape, offset = npy_header(path)
        if dtype not in dtypes or len(shape) != ndim or (ndim == 2 and shape[1] != 2):
            raise DataError(f"index cache {path} holds dtype {dtype}, shape {shape}, where megatron-core writes "
                            f"{'/'.join(sorted(map(str, dtypes)))} of rank {ndim}: {FIX}")
        want = offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if path.stat().st_size != want:
            raise DataError(f"index cache {path} has {path.stat().st_size} bytes, its header says {want}: it is "
                            f"truncated or damaged; {FIX}")


CHUNK = 1 << 22  # sample boundaries checked this many at a time (bounded memory on a run of 10^9 samples)


def _in_range(values, low: int, high: int, path: str, what: str) -> None:
    if len(values) and (int(values.min()) < low or int(values.max()) >= high):
        raise DataError(f"index cache {path} holds {what} outside [{low}, {high}): it is damaged; {FIX}")


def _file(dataset, name: str) -> str:
    """The cache file of one of `dataset`'s indexes, named as megatron-core names it."""
    split = getattr(dataset, "index_split", None) or dataset.split
    return (f"{dataset.config.path_to_cache}/{dataset.unique_description_hash}-{type(dataset).__name__}-"
            f"{split.name}-{name}.npy")


def check_index_values(dataset) -> None:
    """The indexes megatron-core loaded for `dataset` (a GPTDataset, or a BlendedDataset and its parts) index what
    they index: documents of the split, sample boundaries, samples, parts of the blend."""
    parts = getattr(dataset, "datasets", None)
    if parts is not None:  # BlendedDataset
        _in_range(dataset.dataset_index, 0, len(parts), _file(dataset, "dataset_index"), "parts")
        for i, part in enumerate(parts):
            picked = dataset.dataset_sample_index[np.asarray(dataset.dataset_index) == i]
            _in_range(picked, 0, len(part), _file(dataset, "dataset_sample_index"), "samples")
            check_index_values(part)
        return
    docs, samples, shuffle = dataset.document_index, dataset.sample_index, dataset.shuffle_index
    ids = np.asarray(dataset.indices)  # the split's documents (one contiguous range): another split's never leak in
    low, high = (int(ids[0]), int(ids[-1]) + 1) if len(ids) else (0, 0)
    _in_range(docs, low, high, _file(dataset, "document_index"), "document ids")
    lengths, where = dataset.dataset.sequence_lengths, _file(dataset, "sample_index")
    last = None  # a sample boundary is a (document position, token offset inside that document), never going back
    for lo in range(0, len(samples), CHUNK):
        rows = np.asarray(samples[lo:lo + CHUNK], dtype=np.int64)
        _in_range(rows[:, 0], 0, len(docs), where, "document positions")
        _in_range(rows[:, 1], 0, 1 << 62, where, "token offsets")
        if ((rows[:, 1] > 0) & (rows[:, 1] >= lengths[docs[rows[:, 0]]])).any():  # (offset 0: an empty first doc)
            raise DataError(f"index cache {where} holds a token offset past its document's end: it is damaged; {FIX}")
        ahead = rows if last is None else np.concatenate([last, rows])
        moved, shifted = np.diff(ahead[:, 0]), np.diff(ahead[:, 1])
        if ((moved < 0) | ((moved == 0) & (shifted <= 0))).any():
            raise DataError(f"index cache {where} holds sample boundaries that go back: it is damaged; {FIX}")
        last = rows[-1:]
    _in_range(shuffle, 0, max(len(samples) - 1, 0), _file(dataset, "shuffle_index"), "sample ids")


class _NumpyWithoutPickles:
    """numpy as megatron-core's dataset modules see it: the same module, but load() never unpickles."""

    def __getattr__(self, name: str):
        return getattr(np, name)

    @staticmethod
    def load(file, *args, allow_pickle: bool = False, **kwargs):
        return np.load(file, *args, allow_pickle=False, **kwargs)


def no_pickle_numpy(*modules) -> None:
    """Give each of megatron-core's dataset `modules` the numpy whose load() refuses pickles (once)."""
    for module in modules:
        if not isinstance(getattr(module, "numpy", None), _NumpyWithoutPickles):
            module.numpy = _NumpyWithoutPickles()
