"""Tokenize a corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) for hybridpar or Megatron-LM.

    python launch/preprocess_data.py --input corpus.jsonl.zst --json-key text --tokenizer bpe:tokenizer.json \\
        --output-prefix data/corpus --workers 8 --append-eod
    python launch/preprocess_data.py --input notes/*.txt --tokenizer bytes --output-prefix data/notes

JSON lines (.jsonl/.json, optionally .gz/.zst) take the text under --json-key; other files are plain text, one
document per file (or per blank-line block with --blank-line-docs). Prints progress (tokens/s) and a summary.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.data.indexed import DataError, bin_path, idx_path
from hybridpar.data.preprocess import MAX_DOCUMENT_MB, InputStats, iter_documents, preprocess
from hybridpar.data.tokenizer import load_tokenizer
from hybridpar.errors import UserError, write_refused


def cli(argv: list[str]) -> int:
    # Imported here: the tokenizer workers (spawned) import this module, and need neither torch nor the parser.
    from hybridpar.config.cli import parse_command
    from hybridpar.models.config import doc, doc_required

    @dataclass(frozen=True)
    class Options:
        input: list[str] = doc_required("input files (.jsonl[.gz|.zst], .json, or text)")
        tokenizer: str = doc_required("bytes, bpe:PATH, gpt2:DIR or sentencepiece:MODEL")
        output_prefix: str = doc_required("writes PREFIX.bin and PREFIX.idx")
        json_key: str = doc("text", "key of the document text in each JSON line")
        workers: int = doc(1, "tokenizer processes")
        append_eod: bool = doc(True, "end each document with the tokenizer's end-of-document token "
                                     "(--no-append-eod: not)")
        blank_line_docs: bool = doc(False, "text files: one document per blank-line block")
        overwrite: bool = doc(False, "replace an existing PREFIX.bin/.idx")
        strict: bool = doc(False, "refuse a JSON record whose text is null or not a string (otherwise skipped and "
                                  "counted)")
        max_document_mb: float = doc(MAX_DOCUMENT_MB, "refuse a document larger than this (tokenizing one takes tens "
                                                      "of times its size in memory; split such inputs)")

    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/preprocess_data.py")
        if parsed is None:
            return 0
        a, _ = parsed
        if a.workers < 1:
            raise DataError(f"--workers {a.workers}: give at least 1")
        if a.tokenizer.startswith("train-bpe"):
            raise DataError(f"--tokenizer {a.tokenizer}: train a tokenizer first with launch/train_tokenizer.py, "
                            f"then pass bpe:PATH")
        tokenizer = load_tokenizer(a.tokenizer)
        if not a.overwrite and (bin_path(a.output_prefix).exists() or idx_path(a.output_prefix).exists()):
            raise DataError(f"--output-prefix {a.output_prefix}: {a.output_prefix}.bin/.idx already exist; pass "
                            f"--overwrite or another prefix")
        for path in a.input:
            if not Path(path).is_file():
                raise DataError(f"--input {path}: no such file")
        stats = InputStats()
        if not a.max_document_mb > 0:
            raise DataError(f"--max-document-mb {a.max_document_mb}: give a size in MB > 0")
        docs = iter_documents(a.input, a.json_key, a.blank_line_docs, strict=a.strict, stats=stats,
                              max_mb=a.max_document_mb)
        summary = preprocess(docs, a.tokenizer, a.output_prefix, workers=a.workers, append_eod=a.append_eod,
                             progress=True, tokenizer=tokenizer)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full or read-only output file system: one line (the writer removed its files)
        refused = write_refused(e, f"{a.output_prefix}.bin/.idx", "free space there or pass another --output-prefix",
                                paths=[a.output_prefix])
        if refused is None:
            raise
        print(f"error: {refused}", file=sys.stderr)
        return 2
    if stats.skipped:
        print(f"warning: {stats.line()} (pass --strict to refuse them)", file=sys.stderr)
    if summary.documents == 0:
        print(f"warning: the inputs hold no documents: {a.output_prefix}.bin/.idx are empty", file=sys.stderr)
    print(f"wrote {a.output_prefix}.bin/.idx: {summary.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
