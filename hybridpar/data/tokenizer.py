"""Tokenizers behind one small interface: encode, decode, vocab_size, eod_id.

Specs (data.tokenizer):
- `bytes`: the 256 byte values, no files; byte 0 (NUL, absent from text) doubles as the end-of-document token.
- `bpe:PATH`: a Hugging Face `tokenizer.json`; its `<|endoftext|>` token (or the last id) ends documents.
- `train-bpe:N`: a byte-level BPE of N tokens trained with Hugging Face `tokenizers` on the training split of the
  corpus (about a second for 8k tokens on the built-in corpus), cached under data.cache_dir by corpus hash and N.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

EOD_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    vocab_size = 256
    eod_id = 0

    def __init__(self):
        self.spec = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        (directory / "tokenizer.txt").write_text("bytes\n")

    @property
    def fingerprint(self) -> str:
        return "bytes"


class HFTokenizer:
    """A Hugging Face `tokenizers` model (byte-level BPE or any other tokenizer.json)."""

    def __init__(self, tok, spec: str):
        self.tok, self.spec = tok, spec
        self.vocab_size = tok.get_vocab_size()
        eod = tok.token_to_id(EOD_TOKEN)
        self.eod_id = eod if eod is not None else self.vocab_size - 1

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))

    def save(self, directory: Path) -> None:
        self.tok.save(str(directory / "tokenizer.json"))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.tok.to_str().encode()).hexdigest()[:16]


def train_bpe(docs: list[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style: bytes as the initial alphabet, so every text encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


def load_tokenizer(spec: str, train_docs: list[str] | None = None, corpus_sha: str = "",
                   cache_dir: Path | None = None):
    """The tokenizer a `data.tokenizer` spec names. Raises ValueError with the fix for a bad spec."""
    if spec == "bytes":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and arg:
        from tokenizers import Tokenizer

        if not Path(arg).is_file():
            raise ValueError(f"data.tokenizer={spec!r}: no such file {arg!r}; give the path of a tokenizer.json")
        return HFTokenizer(Tokenizer.from_file(arg), spec)
    if kind == "train-bpe":
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if n < 512:
            raise ValueError(f"data.tokenizer={spec!r}: give the vocabulary size, at least 512, e.g. train-bpe:8192")
        from tokenizers import Tokenizer

        path = cache_dir / f"tokenizer-bpe{n}-{corpus_sha[:16]}.json"
        if path.is_file():
            return HFTokenizer(Tokenizer.from_file(str(path)), spec)
        tok = train_bpe(train_docs, n)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return HFTokenizer(tok, spec)
    raise ValueError(f"data.tokenizer={spec!r} is not a tokenizer spec; use bytes, bpe:PATH or train-bpe:N")
