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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from hybridpar.data.indexed import DataError, IndexedWriter, token_dtype
from hybridpar.data.tokenizer import load_tokenizer

BATCH_DOCS = 256


def _open_binary(path: Path):
    """The file's bytes (decompressed for .gz / .zst), line by line."""
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path} is zstd-compressed: pip install zstandard (or decompress it first)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")))
    return open(path, "rb")


def _is_jsonl(path: Path) -> bool:
    return any(path.name.endswith(ext + c) for ext in (".jsonl", ".json") for c in ("", ".gz", ".zst"))


MAX_DOCUMENT_MB = 64.0  # tokenizing a document takes tens of times its size in memory


def _too_big(path: Path, n: int, size: int, max_mb: float) -> DataError:
    return DataError(f"{path}:{n}: a document of {size / 1e6:,.1f} MB, past --max-document-mb {max_mb:g} (tokenizing "
                     f"it takes tens of times its size in memory); split it, or raise the limit")


def _lines(path: Path, max_mb: float = MAX_DOCUMENT_MB) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line; a byte sequence that is not UTF-8 or a line past max_mb names the file
    and the line."""
    try:
        with _open_binary(path) as f:
            for n, raw in enumerate(f, 1):
                if len(raw) > max_mb * 1e6:
                    raise _too_big(path, n, len(raw), max_mb)
                try:
                    yield n, raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{path}:{n} is not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                    f"convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
    except (OSError, EOFError) as e:  # gzip/zstd: damaged or truncated stream
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{path} cannot be read to the end ({e}); is the compressed file complete?") from None


@dataclass
class InputStats:
    """What iter_documents read and left out, for the summary."""
    records: int = 0
    skipped: dict = field(default_factory=dict)  # why -> count (e.g. "null text", "int text")
    empty_files: list = field(default_factory=list)

    def skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def line(self) -> str:
        parts = [f"{n:,} record(s) with {why}" for why, n in self.skipped.items()]
        return ("skipped " + ", ".join(parts)) if parts else ""


def iter_documents(paths: Iterable[Path], json_key: str = "text", blank_line_docs: bool = False,
                   strict: bool = False, stats: InputStats | None = None,
                   max_mb: float = MAX_DOCUMENT_MB) -> Iterator[str]:
    """Every document of the inputs, in order, read lazily. A JSON record whose text is null or not a string is
    skipped and counted in `stats` (with strict: refused), never turned into text such as "None" or "123"; a
    document past max_mb is refused before it is tokenized."""
    stats = stats if stats is not None else InputStats()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise DataError(f"--input {path}: no such file")
        before = stats.records
        if _is_jsonl(path):
            for n, line in _lines(path, max_mb):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    hint = (" (a file holding one JSON array converts with jq -c '.[]' FILE > FILE.jsonl)"
                            if n == 1 and line.lstrip().startswith("[") else "")
                    raise DataError(f"{path}:{n} is not valid JSON ({e.msg}); each line must be one JSON object"
                                    f"{hint}") from None
                if not isinstance(record, dict):
                    kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number",
                            type(None): "null"}[type(record)]
                    raise DataError(f"{path}:{n} is a JSON {kind}, not an object: each line must be one object such "
                                    f"as {{\"{json_key}\": \"...\"}} (a file holding one JSON array converts with "
                                    f"jq -c '.[]' FILE > FILE.jsonl)")
                if json_key not in record:
                    raise DataError(f"{path}:{n} has no key {json_key!r} (it has {list(record)[:5]}); pass "
                                    f"--json-key with the key that holds the text")
                text = record[json_key]
                if not isinstance(text, str):
                    kind = "null" if text is None else type(text).__name__
                    if strict:
                        raise DataError(f"{path}:{n}: {json_key!r} is {kind}, not text; fix the record or drop "
                                        f"--strict to skip such records")
                    stats.skip(f"{kind} {json_key!r}")
                    continue
                stats.records += 1
                yield text
        else:
            block: list[str] = []
            size = 0
            for n, line in _lines(path, max_mb):
                if not blank_line_docs or line.strip():
                    block.append(line)
                    size += len(line)
                    if size > max_mb * 1e6:  # characters: at most the bytes
                        raise _too_big(path, n, size, max_mb)
                elif block:
                    stats.records += 1
                    yield "".join(block)
                    block, size = [], 0
            if block:
                stats.records += 1
                yield "".join(block)
        if stats.records == before:
            stats.empty_files.append(str(path))
            print(f"warning: --input {path} holds no documents", file=sys.stderr)


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
            if (ids == tok.eod_id).any():  # only the bytes tokenizer can: its end-of-document token is NUL
                raise DataError(f"document {summary.documents + 1:,} (in input order) holds the end-of-document "
                                f"token {tok.eod_id} inside its text (a NUL byte with --tokenizer bytes), which would "
                                f"split it in two; remove it from the input, or use another tokenizer")
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
            # In place on a terminal; one line each in a log file, where \r would run the lines together.
            tty = sys.stderr.isatty()
            print(("\r" if tty else "") + summary.line(), end="" if tty else "\n", file=sys.stderr, flush=True)

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
        print(("\r" if sys.stderr.isatty() else "") + summary.line(), file=sys.stderr)
    return summary
