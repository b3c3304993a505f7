"""Provenance: which documents each step of a run trained on, and where a document's tokens were trained.

Every training sample is a pure function of the data settings and its global position, so the questions are index
arithmetic over what the run already built, never a replay of the run:

- step S trained global batch b = TrainState.batch_for(S - 1) (the S-th batch outside the skipped windows: data.
  skip_batches, spike rewinds), positions [b G, (b + 1) G), whatever the data-parallel layout;
- position p is sample i of a megatron-core GPTDataset (a plain run's; in a blend, its dataset_index and
  dataset_sample_index; with data.stages, stream s's n-th sample, hybridpar.data.stages, in pass n // per_pass);
- sample i is read through the dataset's shuffle index, sample index and document index: documents of the
  source's .idx and a token range of each (seq_len + 1 tokens: inputs and the targets one further).

The reverse question (where was document d trained) runs the same maps backwards: the places of d in each document
index (one a pass), the samples whose boundaries enclose them (a binary search of the sample index), their
shuffled numbers (one pass over the shuffle index), then positions: a blend's by one pass over its dataset index, a
staged stream's by a binary search over the batches' per-stream counts and one batch's draws, then steps. Nothing
is cached beyond what the run built (megatron-core's index files in data.cache_dir, memory-mapped) and the staged
sampler's per-batch counts, which this process computes once, as the run did at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from hybridpar.data.positions import batch_number, step_of_batch
from hybridpar.errors import DataError


@dataclass(frozen=True)
class Part:
    """Tokens [start, stop) of document `document` (its number in the source's .idx) in a sample."""
    document: int
    start: int
    stop: int


def sample_parts(ds, i: int) -> tuple[list[Part], int]:
    """Sample i of megatron-core GPTDataset `ds`: the documents and token ranges it reads, in order, and how many
    pad tokens end it (a sample past the split's last token)."""
    if ds.shuffle_index is None:
        ds[0]  # (megatron-core maps its index files lazily, on the first read)
    j = int(ds.shuffle_index[i])
    (k0, off0), (k1, off1) = ds.sample_index[j], ds.sample_index[j + 1]
    extra = int(ds.config.add_extra_token_to_sequence)
    lengths = ds.dataset.sequence_lengths
    parts = []
    for k in range(int(k0), int(k1) + 1):
        doc = int(ds.document_index[k])
        start = int(off0) if k == k0 else 0
        stop = min(int(off1) + extra, int(lengths[doc])) if k == k1 else int(lengths[doc])
        parts.append(Part(doc, start, stop))
    pad = ds.config.sequence_length + extra - sum(p.stop - p.start for p in parts)
    return parts, pad


def samples_with(ds, document: int) -> list[tuple[int, Part]]:
    """The samples of GPTDataset `ds` that read `document`, as (sample number, the part of it they read), in
    sample order."""
    if ds.shuffle_index is None:
        ds[0]
    at = np.flatnonzero(np.asarray(ds.document_index) == document)  # one place an epoch
    if not len(at):
        return []
    starts = np.asarray(ds.sample_index[:, 0])
    n = len(ds.shuffle_index)
    found: dict[int, Part] = {}
    for k in at.tolist():
        # samples j with starts[j] <= k <= starts[j + 1]: from the last one starting before k to the last starting at k
        for j in range(max(0, int(np.searchsorted(starts, k, "left")) - 1), int(np.searchsorted(starts, k, "right"))):
            if j < len(starts) - 1 and starts[j] <= k <= starts[j + 1]:
                found[j] = None
    if not found:
        return []
    shuffled = np.flatnonzero(np.isin(np.asarray(ds.shuffle_index[:n]), np.fromiter(found, np.int64)))
    out = []
    for i in shuffled.tolist():
        parts, _ = sample_parts(ds, i)
        out += [(i, p) for p in parts if p.document == document]
    return out


@dataclass
class Ledger:
    """The training samples of one run, by step and by document."""
    samples: object  # the run's train Samples (hybridpar.data.gpt_data.PlainSamples or stages.StagedDataset)
    global_batch: int
    windows: list[tuple[int, int]]  # skipped batches, 1-based inclusive
    steps: int  # the steps the run trained
    sources: dict[str, str]  # a source's name in data.path / data.stages -> its prefix on disk
    tokenizer: object = None  # the run's (find_text)
    aliases: dict[str, str] = field(default_factory=dict)  # a source's short name (its file name) -> its prefix
    own_group: bool = False  # open_ledger started the process group: close() ends it

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        from hybridpar.data.gpt_data import release_index_readers

        release_index_readers()
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()

    def reads(self, source: str) -> bool:
        """Whether `source` (a name of data.path or data.stages, its file name, or its prefix) is one of its sources."""
        prefix = self.sources.get(source) or self.aliases.get(source, source)
        return prefix in self.sources.values()

    def name_of(self, prefix: str) -> str:
        return next((n for n, p in self.sources.items() if p == prefix), prefix)

    # -- steps and positions ------------------------------------------------------------------------------------
    def batch_of(self, step: int) -> int:
        """The 0-based global batch that 1-based step `step` trained."""
        return batch_number(step, self.windows) - 1

    def step_of(self, batch: int) -> int | None:
        """The 1-based step that trained 0-based global batch `batch` (None: skipped, or past the run's steps)."""
        step = step_of_batch(batch + 1, self.windows)
        return step if step is not None and step <= self.steps else None

    # -- one position -----------------------------------------------------------------------------------------
    def sample(self, position: int) -> dict:
        source, pass_, ds, i = self.samples.locate(position)
        parts, pad = sample_parts(ds, i)
        row = {"position": position, "source": self.name_of(source), "documents": [[p.document, p.start, p.stop] for p in parts]}
        if pass_ is not None:
            row["pass"] = pass_ + 1
        if pad:
            row["pad"] = pad
        return row

    def step(self, step: int) -> list[dict]:
        """Every sample of step `step`'s global batch, in global order (sample k of the batch: data-parallel rank
        k // (G / dp) read it, whatever dp was then)."""
        if not 1 <= step <= self.steps:
            raise DataError(f"--step {step}: the run trained steps 1 to {self.steps}")
        b = self.batch_of(step)
        return [{"step": step, "batch": b + 1, "sample": k, **self.sample(b * self.global_batch + k)}
                for k in range(self.global_batch)]

    # -- one document -----------------------------------------------------------------------------------------
    def document(self, source: str, document: int) -> list[dict]:
        """Every trained step and sample whose tokens include document `document` of `source` (a name of data.path
        or data.stages, or its prefix), with the token range each read; in step order."""
        prefix = self.sources.get(source) or self.aliases.get(source, source)
        if prefix not in self.sources.values():
            raise DataError(f"--document {source}:{document}: the run reads no source of that name; its sources: "
                            f"{', '.join(sorted(self.sources))}")
        lengths = _lengths(prefix)
        if not 0 <= document < len(lengths):
            raise DataError(f"--document {source}:{document}: {source} holds documents 0 to {len(lengths) - 1}")
        s, hits = self.samples, lambda ds: samples_with(ds, document)
        found = s.holding(prefix, hits)  # (position, pass, part)
        out = []
        for position, pass_, part in sorted((f for f in found if f[0] is not None), key=lambda f: f[0]):
            if position >= len(s):
                continue
            step = self.step_of(position // self.global_batch)
            if step is None:
                continue
            row = {"step": step, "sample": position % self.global_batch, "position": position, "source": source,
                   "document": document, "start": part.start, "stop": part.stop}
            if pass_ is not None:
                row["pass"] = pass_
            out.append(row)
        return out

    def find_text(self, text: str, chunk: int = 1 << 24) -> list[tuple[str, int]]:
        """(source, document) of every document of the run's sources whose text holds `text`: its tokens
        looked up in each .bin, a chunk at a time, and the document's decoded text checked. A BPE token at either end
        depends on what surrounds it (a word after a space is another token), so the text is encoded as it is and
        after a space, and of more than 3 tokens the first and last are dropped."""
        found: dict[tuple[str, int], None] = {}
        for ids in (self.tokenizer.encode(text), self.tokenizer.encode(" " + text)):
            found.update(dict.fromkeys(self._find_tokens(np.asarray(ids[1:-1] if len(ids) > 3 else ids), text,
                                                         chunk)))
        return sorted(found)

    def _find_tokens(self, core: np.ndarray, text: str, chunk: int) -> list[tuple[str, int]]:
        from hybridpar.data.indexed import IndexedTokens

        out: list[tuple[str, int]] = []
        if not len(core):
            return out
        for name, prefix in self.sources.items():
            data = IndexedTokens(prefix)
            tokens, starts = data.tokens, np.asarray(data.sequence_pointers) // data.dtype.itemsize
            seen: set[int] = set()
            for a in range(0, len(tokens), chunk):
                window = np.asarray(tokens[a:a + chunk + len(core) - 1])
                hits = np.flatnonzero(window[:len(window) - len(core) + 1] == core[0])
                for k in range(1, len(core)):
                    hits = hits[window[hits + k] == core[k]]
                for at in (a + hits).tolist():
                    doc = int(np.searchsorted(starts, at, "right")) - 1
                    if doc not in seen and text in self.tokenizer.decode(data[doc].tolist()):
                        out.append((name, doc))
                    seen.add(doc)
        return out


def _lengths(prefix: str) -> np.ndarray:
    from hybridpar.data.indexed import IndexedTokens

    return IndexedTokens(prefix).sequence_lengths
