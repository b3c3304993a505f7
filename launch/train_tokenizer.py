"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) on a corpus; writes a tokenizer.json.

    python launch/train_tokenizer.py --input corpus.jsonl --vocab-size 32000 --output tokenizer.json
    python launch/preprocess_data.py --input corpus.jsonl --tokenizer bpe:tokenizer.json --output-prefix data/corpus

Byte-level (GPT-2 style): every text encodes, no unknown tokens; `<|endoftext|>` is the end-of-document token.
Reads the same inputs as launch/preprocess_data.py, streaming.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config.cli import parse_command
from hybridpar.data.indexed import DataError
from hybridpar.data.preprocess import InputStats, iter_documents
from hybridpar.data.tokenizer import bpe_size_error, train_bpe
from hybridpar.errors import UserError
from hybridpar.models.config import doc, doc_required


@dataclass(frozen=True)
class Options:
    input: list[str] = doc_required("input files (.jsonl[.gz|.zst], .json, or text)")
    output: str = doc_required("tokenizer.json to write")
    json_key: str = doc("text", "key of the document text in each JSON line")
    vocab_size: int = doc(32000, "tokens, including the byte alphabet")
    blank_line_docs: bool = doc(False, "text files: one document per blank-line block")
    overwrite: bool = doc(False, "replace an existing --output")
    strict: bool = doc(False, "refuse a JSON record whose text is null or not a string (otherwise skipped and counted)")


def cli(argv: list[str]) -> int:
    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/train_tokenizer.py")
        if parsed is None:
            return 0
        a, _ = parsed
        if bpe_size_error(a.vocab_size, ""):
            raise DataError(bpe_size_error(a.vocab_size, f"--vocab-size {a.vocab_size}"))
        if Path(a.output).is_dir():
            raise DataError(f"--output {a.output} is a directory; name the tokenizer.json file to write")
        if Path(a.output).exists() and not a.overwrite:
            raise DataError(f"--output {a.output} exists; pass --overwrite or another path")
        for path in a.input:
            if not Path(path).is_file():
                raise DataError(f"--input {path}: no such file")
        stats = InputStats()
        tok = train_bpe(iter_documents(a.input, a.json_key, a.blank_line_docs, strict=a.strict, stats=stats),
                        a.vocab_size)
        if stats.records == 0:
            raise DataError(f"--input {' '.join(a.input)} holds no documents: nothing to train on")
        Path(a.output).parent.mkdir(parents=True, exist_ok=True)
        tok.save(a.output)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stats.skipped:
        print(f"warning: {stats.line()} (pass --strict to refuse them)", file=sys.stderr)
    if tok.get_vocab_size() < a.vocab_size:
        print(f"warning: the corpus gave only {tok.get_vocab_size()} tokens, fewer than --vocab-size "
              f"{a.vocab_size} (too little text for that many merges); the model's vocab_size follows the "
              f"tokenizer", file=sys.stderr)
    print(f"wrote {a.output}: {tok.get_vocab_size()} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
