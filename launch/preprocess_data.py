"""Tokenize a corpus into a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) for hybridpar or Megatron-LM.

    python launch/preprocess_data.py --input corpus.jsonl.zst --json-key text --tokenizer bpe:tokenizer.json \\
        --output-prefix data/corpus --workers 8 --append-eod
    python launch/preprocess_data.py --input notes/*.txt --tokenizer bytes --output-prefix data/notes

JSON lines (.jsonl/.json, optionally .gz/.zst) take the text under --json-key; other files are plain text, one
document per file (or per blank-line block with --blank-line-docs). Prints progress (tokens/s) and a summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridpar.data.indexed import DataError, bin_path, idx_path
from hybridpar.data.preprocess import InputStats, iter_documents, preprocess
from hybridpar.data.tokenizer import load_tokenizer


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="input files (.jsonl[.gz|.zst], .json, or text)")
    p.add_argument("--json-key", default="text", help="key of the document text in each JSON line")
    p.add_argument("--tokenizer", required=True, help="bytes, bpe:PATH, gpt2:DIR or sentencepiece:MODEL")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end each document with the tokenizer's end-of-document token")
    p.add_argument("--blank-line-docs", action="store_true", help="text files: one document per blank-line block")
    p.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX.bin/.idx")
    p.add_argument("--strict", action="store_true",
                   help="refuse a JSON record whose text is null or not a string (otherwise skipped and counted)")
    a = p.parse_args(argv)
    try:
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
        docs = iter_documents(a.input, a.json_key, a.blank_line_docs, strict=a.strict, stats=stats)
        summary = preprocess(docs, a.tokenizer, a.output_prefix, workers=a.workers, append_eod=a.append_eod,
                             progress=True, tokenizer=tokenizer)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stats.skipped:
        print(f"warning: {stats.line()} (pass --strict to refuse them)", file=sys.stderr)
    if summary.documents == 0:
        print(f"warning: the inputs hold no documents: {a.output_prefix}.bin/.idx are empty", file=sys.stderr)
    print(f"wrote {a.output_prefix}.bin/.idx: {summary.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
