"""Training data from Megatron indexed datasets: megatron-core's GPTDataset (packing, shuffling) and
BlendedDataset (weighted mixing) behind hybridpar's checks, and the data-parallel loader.

The data position is one global number: samples consumed. Global batch s is samples [s*G, (s+1)*G) of the (blended)
train dataset; data-parallel rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp), cut into microbatches. The
order therefore depends on the seed alone, never on the layout, and a run resumed on another dp or tp size continues
with exactly the samples it would have seen.

Guards around megatron-core (0.16): an empty split makes GPTDataset loop forever looking for an epoch with tokens,
so splits are checked first; its index caches go under data.cache_dir (never next to possibly read-only data);
with several ranks, rank 0 builds the caches while the others wait on a gloo barrier with a long timeout (not the
training process group's), then read them: data.cache_dir must be shared by all nodes, as in Megatron.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import math
import sys
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from hybridpar.data.index_cache import check_index_files, check_index_values, no_pickle_numpy
from hybridpar.data.indexed import DataError, IndexedTokens, bin_path, idx_path
from hybridpar.data.stages import PASS_SEED_STRIDE, parse_blend

SPLITS = ("train", "valid", "test")
IGNORE_INDEX = -100  # a target that counts zero in the loss (torch's cross_entropy default)
SURPLUS = 0.005  # extra samples per blended component, as megatron-core's builder draws


def open_blend(path: str) -> tuple[list[tuple[float, str]], dict[str, IndexedTokens]]:
    """data.path parsed once, and each of its prefixes opened and checked once (missing files, magic, version,
    dtype code, truncation)."""
    blend = parse_blend(path)
    return blend, {prefix: IndexedTokens(prefix) for _, prefix in blend}


def split_ranges(n: int, fractions: tuple[float, float, float]) -> list[tuple[int, int]]:
    """Document ranges of train/valid/test, rounded as megatron-core's builder rounds them."""
    bounds, acc = [0.0], 0.0
    for f in fractions:
        acc += f
        bounds.append(min(acc, 1.0))
    return [(int(round(a * n)), int(round(b * n))) for a, b in zip(bounds[:-1], bounds[1:])]


class _TokenizerView:
    """What megatron-core's GPTDataset reads from a tokenizer."""

    def __init__(self, tokenizer):
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod_id
        self.unique_identifiers = {"class": "hybridpar", "spec": tokenizer.spec, "eod": self.eod,
                                   "vocab_size": self.vocab_size}


def _defer_megatron_core_init() -> None:
    """megatron.core's package __init__ imports its whole model stack (about 5 s of every process's start-up on the
    development machine); the data layer needs only megatron.core.datasets. Register megatron.core unexecuted, with
    a module __getattr__ that runs the real __init__ the first time anything asks it for a name that is not an
    already imported submodule, so other code that uses megatron.core in the same process still gets all of it."""
    if "megatron.core" in sys.modules:
        return
    spec = importlib.util.find_spec("megatron.core")
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        return
    pkg = importlib.util.module_from_spec(spec)

    def __getattr__(name: str):
        sub = sys.modules.get(f"megatron.core.{name}")
        if sub is not None:
            return sub
        if name.startswith("__") or importlib.machinery.PathFinder.find_spec(name, pkg.__path__) is not None:
            raise AttributeError(name)  # a submodule not imported yet: the import system imports it next
        del pkg.__getattr__  # once: from here on it is the ordinary package
        spec.loader.exec_module(pkg)
        return getattr(pkg, name)

    pkg.__getattr__ = __getattr__
    import megatron

    sys.modules["megatron.core"] = pkg
    megatron.core = pkg
    try:
        import megatron.core.parallel_state  # noqa: F401  (first, as __init__ does: it and utils import each other)
    except Exception:
        del sys.modules["megatron.core"]  # another megatron-core layout: import it the ordinary way
        del megatron.core


def _megatron():
    """Import megatron-core's dataset classes quietly (it warns about optional NVIDIA packages on import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _defer_megatron_core_init()
        from megatron.core.datasets.blended_dataset import BlendedDataset
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        from megatron.core.datasets.utils import Split
    no_pickle_numpy(sys.modules[BlendedDataset.__module__], sys.modules[GPTDataset.__module__])
    logging.getLogger("megatron").setLevel(logging.WARNING)
    return BlendedDataset, GPTDataset, GPTDatasetConfig, IndexedDataset, Split


def _files_key(blend) -> str:
    """The identity of the blend's files (path, size, modification time): megatron-core keys its index caches by
    the prefix alone, so a prefix preprocessed again must get caches of its own (a stale one indexes old offsets)."""
    h = hashlib.sha256()
    for _, prefix in blend:
        for f in (bin_path(prefix), idx_path(prefix)):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def _build(blend, split: str, fractions, seq_len: int, seed: int, tokenizer, num_samples: dict[str, int],
           cache_dir: Path) -> dict[str, object]:
    BlendedDataset, GPTDataset, GPTDatasetConfig, IndexedDataset, Split = _megatron()
    index_dir = cache_dir / "megatron-index" / _files_key(blend)
    check_index_files(index_dir)  # before megatron-core reads any of them (hybridpar/data/index_cache.py)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_len, blend=([p for _, p in blend], [w for w, _ in blend]),
        split=split, path_to_cache=str(index_dir),
        tokenizer=_TokenizerView(tokenizer),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mid_level_dataset_surplus=SURPLUS)
    low = {p: IndexedDataset(p, multimodal=False, mmap=True) for _, p in blend}
    out = {}
    try:
        for name, n_samples in num_samples.items():
            parts = []
            for weight, prefix in blend:
                beg, end = split_ranges(len(low[prefix]), fractions)[SPLITS.index(name)]
                size = n_samples if len(blend) == 1 else int(math.ceil(math.ceil(n_samples * weight) * (1 + SURPLUS)))
                parts.append(GPTDataset(low[prefix], prefix, np.arange(beg, end, dtype=np.int32), size, Split[name],
                                        config))
            size = blend_size(parts, blend, n_samples) if name == "train" and n_samples is not None else n_samples
            out[name] = parts[0] if len(parts) == 1 else BlendedDataset(parts, [w for w, _ in blend], size, config)
            check_index_values(out[name])
    except MemoryError as e:  # (its document index is passes x documents: short documents make it the largest)
        raise DataError(f"megatron-core's index of the {name} split ({n_samples:,} samples of {seq_len} tokens over "
                        f"{', '.join(f'{len(low[p]):,} documents of {p}' for _, p in blend)}) did not fit in memory "
                        f"({str(e)[:80]}); lower train.steps, or add data so fewer passes are needed") from None
    except ValueError as e:
        if "pickle" not in str(e):
            raise
        raise DataError(f"an index cache under {index_dir} was replaced by a pickle while it was read (refused, "
                        f"not unpickled); delete that directory and check who else writes to data.cache_dir") from None
    return out


def blend_size(parts, blend, n_samples: int) -> int:
    """The samples a blend of `parts` (megatron-core GPTDatasets, each built in whole passes over its split for at
    least its share of n_samples) holds: every sample its parts hold, not only the n_samples it was built for, so
    that batches a run skips (data.skip_batches, also added on a resume) draw on the parts' last passes. The
    blending order is greedy, sample by sample (part k's count after n samples is at most w_k x n + 1), so its first
    n_samples are the same whatever the size: the size does not change the order a run reads. Bounded by
    BLEND_SKIP_ROOM (the blending index costs 10 bytes a sample)."""
    total = sum(w for w, _ in blend)
    held = min(int((len(p) - 2) * total / w) for p, (w, _) in zip(parts, blend))
    return max(n_samples, min(held, n_samples + max(int(n_samples * BLEND_SKIP_ROOM[0]), BLEND_SKIP_ROOM[1])))


BLEND_SKIP_ROOM = (0.1, 1 << 16)  # a train blend holds up to 10% (at least 65,536) samples past what it is built for


def check_prefixes(prefixes, indexes: dict[str, IndexedTokens], split: str, fractions, tokenizer, vocab_size: int,
                   splits) -> None:
    """What megatron-core must never see: an empty index, token ids past the vocabulary, an empty split (it would
    loop forever looking for an epoch with tokens)."""
    for prefix in prefixes:
        tokens = indexes[prefix]
        if len(tokens) == 0:
            raise DataError(f"data.path: {prefix} holds no documents; preprocess some text into it first")
        tokens.check_vocab(vocab_size, tokenizer.vocab_size)
        lengths = np.asarray(tokens.sequence_lengths)
        for name in splits:
            beg, end = split_ranges(len(tokens), fractions)[SPLITS.index(name)]
            if end <= beg or lengths[beg:end].sum() == 0:
                raise DataError(f"data.split={split!r} leaves the {name} split of {prefix} empty ({len(tokens)} "
                                f"documents, {name} gets [{beg}, {end})); give it a larger weight or more data")


def rank_zero_first(build):
    """build() on rank 0 (it writes megatron-core's index caches), then on the other ranks (they read them), which
    wait on a gloo group whose timeout covers long builds, not on the training process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return build()
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=4))
    out = build() if dist.get_rank() == 0 else None
    dist.barrier(group=group)
    if dist.get_rank() != 0:
        out = build()
    dist.destroy_process_group(group)
    return out


def build_gpt_datasets(blend: list[tuple[float, str]], indexes: dict[str, IndexedTokens], split: str,
                       fractions: tuple[float, float, float], seq_len: int, seed: int, tokenizer, vocab_size: int,
                       num_samples: dict[str, int], cache_dir: Path):
    """The datasets of each requested split ({'train': n, 'valid': m}) of a parsed blend whose prefixes are open in
    `indexes`, checked before megatron-core sees them. Needs torch.distributed initialised (hybridpar's launcher
    does so even for one process): megatron-core's BlendedDataset asks for the rank."""
    check_prefixes([p for _, p in blend], indexes, split, fractions, tokenizer, vocab_size, num_samples)
    return rank_zero_first(lambda: _build(blend, split, fractions, seq_len, seed, tokenizer, num_samples, cache_dir))


def build_passes(prefix: str, passes: range, split: str, fractions, seq_len: int, seed: int, tokenizer,
                 cache_dir: Path, n_valid: int = 0) -> tuple[list, object]:
    """Passes `passes` over one prefix's train split in sequences of seq_len tokens (pass e: one epoch in
    megatron-core's order for seed + 7919 e, hybridpar.data.stages), and with n_valid its first n_valid validation
    samples (else None); checked prefixes only."""
    def one(split_name: str, seed_: int, n):
        return _build([(1.0, prefix)], split, fractions, seq_len, seed_, tokenizer, {split_name: n}, cache_dir)

    return rank_zero_first(lambda: ([one("train", seed + PASS_SEED_STRIDE * e, None)["train"] for e in passes],
                                    one("valid", seed, n_valid)["valid"] if n_valid else None))


def release_index_readers() -> None:
    """megatron-core caches _IndexReader.__getitem__ with functools.lru_cache on the method: the cache's keys hold
    every reader ever read from, and with it the memory map of its .idx file, for the life of the process. A run's
    data, closed, lets them go (a process that trains, evaluates or converts again keeps no file of the last run
    open)."""
    module = sys.modules.get("megatron.core.datasets.indexed_dataset")
    clear = getattr(getattr(getattr(module, "_IndexReader", None), "__getitem__", None), "cache_clear", None)
    if clear is not None:
        clear()


class Samples(Protocol):
    """What the loader reads and provenance asks (PlainSamples, BlendSamples, hybridpar.data.stages.StagedDataset):
    samples by global position, and where each comes from."""
    per_pass: int | None  # samples one pass over the split holds (None: built to a blend's or stages' shares)

    def __len__(self) -> int: ...
    def rows(self, positions: range) -> list[dict]: ...  # consecutive positions inside one global batch
    def micro_batch(self, batch: int, per_rank: int) -> int: ...  # sequences per microbatch in 0-based batch
    # (source prefix, pass (None: one split read in order), its megatron-core GPTDataset, the sample in it)
    def locate(self, position: int) -> tuple[str, int | None, object, int]: ...
    # (position or None, pass, what hits found) of each sample of source `prefix` that hits(GPTDataset) ->
    # [(sample, found)] finds
    def holding(self, prefix: str, hits) -> list[tuple[int | None, int | None, object]]: ...


class PlainSamples:
    """A megatron-core GPTDataset or BlendedDataset as Samples: every batch in microbatches of `micro`."""

    def __init__(self, dataset, micro: int, per_pass: int | None = None):
        self.dataset, self.micro, self.per_pass = dataset, micro, per_pass

    def __len__(self) -> int:
        return len(self.dataset)

    def rows(self, positions: range) -> list[dict]:
        return [self.dataset[i] for i in positions]

    def locate(self, position: int) -> tuple[str, int | None, object, int]:
        return str(self.dataset.dataset_path), None, self.dataset, position

    def holding(self, prefix: str, hits) -> list[tuple[int | None, int | None, object]]:
        return [(i, None, found) for i, found in hits(self.dataset)] if str(self.dataset.dataset_path) == prefix else []

    def micro_batch(self, batch: int, per_rank: int) -> int:
        return self.micro



class BlendSamples(PlainSamples):
    """A megatron-core BlendedDataset as Samples: position p is sample dataset_sample_index[p] of part
    dataset_index[p]."""

    def locate(self, position: int) -> tuple[str, int | None, object, int]:
        ds = self.dataset
        part = ds.datasets[int(ds.dataset_index[position])]
        return str(part.dataset_path), None, part, int(ds.dataset_sample_index[position])

    def holding(self, prefix: str, hits) -> list[tuple[int | None, int | None, object]]:
        ds, found = self.dataset, []
        index, sample_index = np.asarray(ds.dataset_index), np.asarray(ds.dataset_sample_index)
        for d, part in enumerate(ds.datasets):
            if str(part.dataset_path) == prefix:
                where = dict(hits(part))
                mine = np.flatnonzero((index == d) & np.isin(sample_index, np.fromiter(where, np.int64)))
                found += [(int(p), None, where[int(sample_index[p])]) for p in mine]
        return found

class GlobalBatchLoader:
    """This data-parallel rank's microbatches of a global batch (0-based), with the next steps' batches read ahead
    by a background thread (the device never waits on disk), and every batch's token ids checked against the vocab.
    Which batch a step trains is the run's position (hybridpar.data.positions, through batch_for)."""

    def __init__(self, dataset: Samples, global_batch: int, dp_rank: int, dp_size: int, vocab_size: int,
                 name: str, prefetch: int = 2, pin_memory: bool = False):
        self.dataset, self.G, self.name = dataset, global_batch, name
        self.dp_rank, self.per_rank, self.vocab_size = dp_rank, global_batch // dp_size, vocab_size
        self.prefetch, self.pin = prefetch, pin_memory
        self.n_batches = len(dataset) // global_batch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"hybridpar-{name}-loader")
        self._pending: dict = {}
        self.crc32: dict[int, int] = {}  # batch -> CRC-32 of this rank's inputs and targets (pop it after use)

    def sample_indices(self, batch: int, rank_shift: int = 0) -> range:
        first = batch * self.G + (self.dp_rank + rank_shift) % (self.G // self.per_rank) * self.per_rank
        return range(first, first + self.per_rank)

    def load(self, batch: int, rank_shift: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Global batch `batch`'s microbatches for this rank (with rank_shift, data-parallel rank + shift's), read
        now (no read-ahead)."""
        idx = self.sample_indices(batch, rank_shift)
        rows = self.dataset.rows(idx)
        x = torch.stack([r["tokens"] for r in rows])
        y = torch.stack([r["labels"] for r in rows])
        mask = torch.stack([r["loss_mask"] for r in rows])
        y = y.masked_fill(mask == 0, IGNORE_INDEX)
        micro = self.dataset.micro_batch(batch, self.per_rank)
        hi, lo = int(torch.maximum(x.max(), y.max())), int(x.min())
        if hi >= self.vocab_size or lo < 0:
            raise DataError(f"{self.name} samples {idx.start}..{idx.stop - 1} hold token id {hi if lo >= 0 else lo} "
                            f"outside [0, model.vocab_size={self.vocab_size}): the data was tokenized with another "
                            f"tokenizer, or is damaged")
        # What this rank trains on in batch `batch`, in 32 bits: equal across a kill and resume, or between two runs,
        # means the same tokens and targets in the same order (logged as batch_crc32).
        self.crc32[batch] = zlib.crc32(y.numpy().tobytes(), zlib.crc32(x.numpy().tobytes()))
        if self.pin:
            x, y = x.pin_memory(), y.pin_memory()
        return [(x[m:m + micro], y[m:m + micro]) for m in range(0, self.per_rank, micro)]

    def microbatches(self, step: int, batch_for=lambda step: step) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The microbatches that 0-based optimizer step `step` trains: global batch batch_for(step) (the step
        itself, or past the batches a run skips: TrainState.batch_for), with the next steps' batches read ahead."""
        index = batch_for(step)
        if index >= self.n_batches:
            raise DataError(f"{self.name} data has {len(self.dataset)} samples, {self.n_batches} global batches; "
                            f"step {step + 1} would train batch {index + 1}, past its end"
                            + (" (skipped batches moved it there: raise spike.skip x spike.max_rewinds, which "
                               "the split is built for, or skip fewer)" if index != step else ""))
        future = self._pending.pop(index, None)
        batch = future.result() if future is not None else self.load(index)
        for s in [s for s in self._pending if s < index]:
            self._pending.pop(s).cancel()
        for s in [s for s in list(self.crc32) if s < index]:  # list(): one atomic copy (the reader thread adds)
            del self.crc32[s]
        for s in range(step + 1, step + 1 + self.prefetch):
            s = batch_for(s)
            if s < self.n_batches and s not in self._pending:
                self._pending[s] = self._pool.submit(self.load, s)
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
