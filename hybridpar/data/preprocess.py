"""Text -> Megatron indexed dataset: streaming, parallel tokenization with bounded memory.

Inputs: JSON lines (`.jsonl`, `.json`, optionally `.gz` or `.zst` compressed; the text under --json-key), or plain
text files (one document per file, or per blank-line-separated block). Documents are read lazily, tokenized in
batches by a pool of worker processes with at most a few batches in flight, and written in input order, so memory
stays flat whatever the corpus size.
"""

from __future__ import annotations

import gzip
import io
import json
import multiprocessing as mp
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from hybridpar.data.indexed import DataError, IndexedWriter, token_dtype
from hybridpar.data.tokenizer import load_tokenizer

BATCH_DOCS = 256


def _open_text(path: Path):
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed: pip install zstandard (or decompress it first)") from None
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8")
    return open(path, encoding="utf-8")


def _is_jsonl(path: Path) -> bool:
    return any(path.name.endswith(ext + c) for ext in (".jsonl", ".json") for c in ("", ".gz", ".zst"))


def iter_documents(paths: Iterable[Path], json_key: str = "text", blank_line_docs: bool = False) -> Iterator[str]:
    """Every document of the inputs, in order, read lazily."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"--input {path}: no such file")
        if _is_jsonl(path):
            with _open_text(path) as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object") from None
                    if not isinstance(record, dict) or json_key not in record:
                        keys = list(record)[:5] if isinstance(record, dict) else type(record).__name__
                        raise DataError(f"{path}:{n} has no key {json_key!r} (it has {keys}); pass --json-key")
                    yield str(record[json_key])
        else:
            with _open_text(path) as f:
                if not blank_line_docs:
                    yield f.read()
                    continue
                block: list[str] = []
                for line in f:
                    if line.strip():
                        block.append(line)
                    elif block:
                        yield "".join(block)
                        block = []
                if block:
                    yield "".join(block)


_worker_tok = None


def _init_worker(spec: str) -> None:
    global _worker_tok
    import os

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tok = load_tokenizer(spec)


def _encode(docs: list[str]) -> tuple[list[np.ndarray], int]:
    """Runs in a worker: token arrays (cheap to send back, unlike lists of ints) and the text's byte count."""
    return ([np.asarray(ids, dtype=np.int32) for ids in _worker_tok.encode_batch(docs)],
            sum(len(d.encode("utf-8")) for d in docs))


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch = []
    for d in docs:
        batch.append(d)
        if len(batch) == BATCH_DOCS:
            yield batch
            batch = []
    if batch:
        yield batch


@dataclass
class Summary:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        mb = self.bytes / 1e6
        return (f"{self.documents:,} documents, {self.tokens:,} tokens, {mb:,.1f} MB of text, "
                f"{self.bytes / max(self.tokens, 1):.2f} bytes/token, {self.seconds:.1f}s "
                f"({mb / max(self.seconds, 1e-9):.2f} MB/s, {self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)")


def preprocess(docs: Iterator[str], tokenizer_spec: str, output_prefix: str | Path, workers: int = 1,
               append_eod: bool = True, progress: bool = False, tokenizer=None) -> Summary:
    """Tokenize `docs` into OUTPUT_PREFIX.bin/.idx. Empty documents (no tokens, no EOD) are skipped."""
    tok = tokenizer or load_tokenizer(tokenizer_spec)
    summary, start, last_print = Summary(), time.perf_counter(), 0.0

    def write(writer: IndexedWriter, encoded: list, n_bytes: int) -> None:
        nonlocal last_print
        for ids in encoded:
            ids = np.asarray(ids, dtype=np.int64)
            if append_eod:
                ids = np.append(ids, tok.eod_id)
            if ids.size:
                writer.add_document(ids)
                summary.documents += 1
                summary.tokens += int(ids.size)
        summary.bytes += n_bytes
        now = time.perf_counter()
        if progress and now - last_print > 1.0:
            last_print, summary.seconds = now, now - start
            print(f"\r{summary.line()}", end="", file=sys.stderr, flush=True)

    with IndexedWriter(output_prefix, token_dtype(tok.vocab_size)) as writer:
        if workers <= 1:
            for batch in _batches(docs):
                write(writer, tok.encode_batch(batch), sum(len(d.encode("utf-8")) for d in batch))
        else:
            ctx = mp.get_context("spawn")
            with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_spec,)) as pool:
                in_flight: deque = deque()
                for batch in _batches(docs):
                    in_flight.append(pool.apply_async(_encode, (batch,)))
                    if len(in_flight) >= 4 * workers:  # bounded: memory does not grow with the corpus
                        write(writer, *in_flight.popleft().get())
                while in_flight:
                    write(writer, *in_flight.popleft().get())
    summary.seconds = time.perf_counter() - start
    if progress:
        print(f"\r{summary.line()}", file=sys.stderr)
    return summary
