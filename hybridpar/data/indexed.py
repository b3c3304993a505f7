"""The Megatron indexed dataset format (.bin + .idx), written and read by hybridpar itself, with clear errors.

Files written here read back in megatron-core's IndexedDataset with identical tokens, and files written by
megatron-core's IndexedDatasetBuilder read here (tests/test_indexed.py checks both directions).

PREFIX.bin: the tokens of every sequence, back to back, in one dtype.
PREFIX.idx, little-endian:
    b"MMIDIDX\\x00\\x00"               9-byte magic
    version              uint64       1
    dtype code           uint8        1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    sequence count  N    uint64
    document count  D    uint64       (len of document_indices = documents + 1)
    sequence_lengths     int32[N]     tokens per sequence
    sequence_pointers    int64[N]     byte offset of each sequence in .bin
    document_indices     int64[D]     0, then the sequence count after each document
hybridpar writes one sequence per document (as Megatron's preprocessing does without sentence splitting).
"""

from __future__ import annotations

import os
import struct
from array import array
from pathlib import Path

import numpy as np

from hybridpar.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # 34 bytes


def token_dtype(vocab_size: int) -> type:
    """The smallest dtype Megatron uses for a vocabulary: uint16 up to 65,536 tokens, else int32."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


class IndexedWriter:
    """Streams documents into PREFIX.bin; finalize() writes PREFIX.idx. Memory: 4 bytes per document.

    Writes go to PREFIX.bin.tmp / PREFIX.idx.tmp and are renamed by finalize(), so an interrupted run leaves no
    half-written dataset under the real names.
    """

    def __init__(self, prefix: str | Path, dtype=np.uint16):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        if self.dtype not in CODES:
            raise DataError(f"dtype {self.dtype} has no Megatron code; use one of {sorted(map(str, CODES))}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(f"{self.prefix}.bin.tmp", "wb")
        self.lengths = array("i")
        self.n_tokens = 0

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and tokens.min() < 0:
            raise DataError(f"token id {int(tokens.min())} is negative: token ids are >= 0")
        if tokens.size and tokens.max() > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(tokens.max())} does not fit {self.dtype}; write with a wider dtype")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes(order="C"))
        self.lengths.append(int(tokens.size))
        self.n_tokens += int(tokens.size)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int32) if len(self.lengths) else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)
        with open(f"{self.prefix}.idx.tmp", "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, CODES[self.dtype], len(lengths), len(doc_idx)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(doc_idx.tobytes())
        os.replace(f"{self.prefix}.bin.tmp", bin_path(self.prefix))
        os.replace(f"{self.prefix}.idx.tmp", idx_path(self.prefix))

    def __enter__(self):
        return self

    def discard(self) -> None:
        """Remove the temporary files; the real names are untouched."""
        try:
            self._bin.close()
        except OSError:  # a full disk refuses the buffered tail as well
            pass
        for suffix in (".bin.tmp", ".idx.tmp"):
            Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)

    def __exit__(self, exc_type, *_):
        if exc_type is not None:  # leave nothing behind
            return self.discard()
        try:
            self.finalize()
        except BaseException:  # a full disk while the index is written, say
            self.discard()
            raise


class IndexedTokens:
    """A memory-mapped indexed dataset, validated on open: magic, version, dtype code, sizes, .bin length."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise DataError(f"data.path {self.prefix!r}: {p} does not exist; give the prefix of a .bin/.idx "
                                f"pair (as written by launch/preprocess_data.py)")
        size = ip.stat().st_size
        with open(ip, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < _HEADER.size or head[:9] != MAGIC:
            raise DataError(f"{ip} is not a Megatron index (bad magic {head[:9]!r}, want {MAGIC!r}); re-run "
                            f"launch/preprocess_data.py")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{ip} has index version {version}; hybridpar reads version {VERSION}")
        if code not in DTYPES:
            raise DataError(f"{ip} has unknown dtype code {code}; expected one of {sorted(DTYPES)}")
        self.dtype = np.dtype(DTYPES[code])
        want = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
        if size < want:
            raise DataError(f"{ip} is truncated: {size} bytes, the header promises {want}")
        idx = np.memmap(ip, mode="r", dtype=np.uint8)
        off = _HEADER.size
        self.sequence_lengths = idx[off:off + 4 * n_seq].view(np.int32)
        off += 4 * n_seq
        self.sequence_pointers = idx[off:off + 8 * n_seq].view(np.int64)
        off += 8 * n_seq
        self.document_indices = idx[off:off + 8 * n_doc].view(np.int64)
        n_bytes = self._check_index(ip)
        bin_size = bp.stat().st_size
        if bin_size < n_bytes:
            raise DataError(f"{bp} is {bin_size:,} bytes but its index says {n_bytes:,}: the file is truncated; "
                            f"copy it again or re-run launch/preprocess_data.py")
        if bin_size > n_bytes:
            raise DataError(f"{bp} is {bin_size:,} bytes but its index {ip} describes {n_bytes:,}: the two files "
                            f"belong to different datasets; re-run launch/preprocess_data.py")
        self.tokens = (np.memmap(bp, mode="r", dtype=self.dtype, shape=(n_bytes // self.dtype.itemsize,))
                       if n_bytes else np.zeros(0, self.dtype))

    def _check_index(self, ip: Path, chunk: int = 1 << 22) -> int:
        """The whole index, vectorised in chunks (bounded memory): sizes >= 0, each pointer = the previous one plus
        the previous size, document boundaries from 0 to the sequence count and never decreasing. Returns the .bin
        length in bytes the index describes; DataError naming the first bad entry otherwise."""
        sizes, pointers, docs, item = self.sequence_lengths, self.sequence_pointers, self.document_indices, \
            self.dtype.itemsize
        fix = "re-run launch/preprocess_data.py"
        expect = 0  # byte offset where the next sequence must start
        for lo in range(0, len(sizes), chunk):
            s = sizes[lo:lo + chunk].astype(np.int64)
            if (s < 0).any():
                i = lo + int(np.argmax(s < 0))
                raise DataError(f"{ip}: sequence {i} has a negative size ({int(sizes[i])}); {fix}")
            want = expect + np.concatenate(([0], np.cumsum(s[:-1] * item)))
            bad = pointers[lo:lo + chunk] != want
            if bad.any():
                i = lo + int(np.argmax(bad))
                raise DataError(f"{ip}: sequence {i} points at byte {int(pointers[i])}, but the sizes before it "
                                f"put it at {int(want[i - lo])}; {fix}")
            expect = int(want[-1] + s[-1] * item)
        if not len(docs):  # (Megatron's index lists at least the boundary 0; megatron-core indexes docs[0])
            raise DataError(f"{ip} lists no document boundaries (a Megatron index starts with boundary 0); {fix}")
        if docs[0] != 0 or docs[-1] != len(sizes):
            raise DataError(f"{ip}: document boundaries run from {int(docs[0])} to {int(docs[-1])}, not from 0 to "
                            f"the {len(sizes)} sequences; {fix}")
        for lo in range(0, len(docs) - 1, chunk):
            step = np.diff(docs[lo:lo + chunk + 1])
            if (step < 0).any():
                i = lo + 1 + int(np.argmax(step < 0))
                raise DataError(f"{ip}: document boundary {i} ({int(docs[i])}) is below the one before it "
                                f"({int(docs[i - 1])}); {fix}")
        return expect

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def n_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[i])])

    def check_vocab(self, vocab_size: int, tokenizer_vocab: int | None = None, full_scan_bytes: int = 1 << 30) -> None:
        """The dtype can hold the tokenizer's vocabulary, and no token id is >= vocab_size (the model's): a full
        scan for files up to full_scan_bytes, else 64 evenly spaced 1M-token chunks (batches are checked again as
        they are read)."""
        if self.dtype.kind == "f":
            raise DataError(f"{bin_path(self.prefix)} holds {self.dtype} values, not token ids")
        need = tokenizer_vocab or vocab_size
        if need > np.iinfo(self.dtype).max + 1:
            raise DataError(f"{bin_path(self.prefix)} stores {self.dtype}, which cannot hold the {need} tokens of "
                            f"the tokenizer: it was written for another tokenizer; re-run launch/preprocess_data.py")
        tokens = self.tokens
        if tokens.nbytes > full_scan_bytes:
            starts = np.linspace(0, len(tokens) - (1 << 20), 64, dtype=np.int64)
            tokens = np.concatenate([tokens[s:s + (1 << 20)] for s in starts])
        hi = int(tokens.max()) if len(tokens) else -1
        lo = int(tokens.min()) if len(tokens) and self.dtype.kind == "i" else 0
        if lo < 0:
            raise DataError(f"{bin_path(self.prefix)} holds token id {lo}: token ids are >= 0, so the file is damaged "
                            f"or not token data; re-run launch/preprocess_data.py")
        if hi >= vocab_size:
            raise DataError(f"{bin_path(self.prefix)} holds token id {hi} >= model.vocab_size={vocab_size}: it was "
                            f"tokenized with another tokenizer; use that tokenizer or re-run launch/preprocess_data.py")
