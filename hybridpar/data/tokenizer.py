"""Tokenizers behind one small interface: encode, decode, vocab_size, eod_id.

Specs (data.tokenizer, and --tokenizer of launch/preprocess_data.py):
- `bytes`: the 256 byte values, no files; byte 0 (NUL, absent from text) doubles as the end-of-document token.
- `bpe:PATH`: a Hugging Face `tokenizer.json`; its end-of-document token (the first of EOD_TOKENS it has) ends
  documents; one without any is refused.
- `gpt2:DIR`: GPT-2's byte-level BPE from `vocab.json` + `merges.txt` (or OpenAI's `encoder.json` + `vocab.bpe`),
  read offline; 50,257 tokens, `<|endoftext|>` = 50256.
- `sentencepiece:MODEL`: a SentencePiece `.model` file; its EOS piece ends documents (one without is refused).

A document's own text never produces the end-of-document id: a literal `<|endoftext|>` in it is encoded as text,
and the bytes tokenizer refuses a NUL (hybridpar.data.preprocess).
- `train-bpe:N`: a byte-level BPE of N tokens trained with Hugging Face `tokenizers` on the training split of the
  built-in corpus (about a second for 8k tokens), cached under data.cache_dir by corpus hash and N.
  `python launch/train_tokenizer.py` trains one on your own files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Protocol

from hybridpar.errors import ConfigError, first_line

EOD_TOKEN = "<|endoftext|>"  # what hybridpar's trained BPEs use
EOD_TOKENS = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>")  # GPT-2, Llama 3, Llama 2 / Mistral, Gemma


class Tokenizer(Protocol):
    """What every tokenizer here provides (ByteTokenizer, HFTokenizer, SentencePieceTokenizer)."""
    vocab_size: int
    eod_id: int  # the end-of-document id

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, directory: Path) -> None: ...  # its files, for a checkpoint or run dir

    @property
    def fingerprint(self) -> str: ...  # equal for tokenizers that encode alike


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
        eod = [i for i in map(tok.token_to_id, EOD_TOKENS) if i is not None]
        if not eod:
            raise ConfigError(f"data.tokenizer={spec!r} has no end-of-document token ({', '.join(EOD_TOKENS)}); "
                              f"add one as a special token (launch/train_tokenizer.py adds {EOD_TOKEN})")
        self.eod_id = eod[0]
        tok.encode_special_tokens = True  # a literal "<|endoftext|>" in a text is text, not a document boundary

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


class SentencePieceTokenizer:
    def __init__(self, path: str, spec: str):
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError(f"data.tokenizer={spec!r} needs the sentencepiece package: pip install sentencepiece")
        self.path, self.spec = path, spec
        self.sp = _read(spec, path, "SentencePiece .model",
                        lambda: sentencepiece.SentencePieceProcessor(model_file=path))
        self.vocab_size = self.sp.get_piece_size()
        if self.sp.eos_id() < 0:
            raise ConfigError(f"data.tokenizer={spec!r} has no EOS piece to end documents with; train it with an "
                              f"eos_id (SentencePiece's default, 2)")
        self.eod_id = self.sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def save(self, directory: Path) -> None:
        (directory / "tokenizer.model").write_bytes(Path(self.path).read_bytes())

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(Path(self.path).read_bytes()).hexdigest()[:16]


def _gpt2_bpe(directory: str, spec: str):
    """GPT-2's tokenizer from its two files, offline."""
    from tokenizers import Tokenizer as HFModel, decoders, models, pre_tokenizers

    d = Path(directory)
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (d / vocab).is_file() and (d / merges).is_file():
            break
    else:
        raise ConfigError(f"data.tokenizer={spec!r}: {directory!r} holds neither vocab.json + merges.txt nor "
                         f"encoder.json + vocab.bpe; give the directory of GPT-2's tokenizer files")
    tok = HFModel(_read(spec, d / vocab, f"GPT-2's {vocab} + {merges}",
                          lambda: models.BPE.from_file(str(d / vocab), str(d / merges))))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _read(spec: str, path, what: str, load):
    """load(), with a damaged or truncated file as one ConfigError naming it."""
    try:
        return load()
    except Exception as e:  # tokenizers and sentencepiece raise plain Exception / RuntimeError for bad files
        raise ConfigError(f"data.tokenizer={spec!r}: {path} is not a valid {what} ({first_line(e, 160)}); the file "
                          f"is damaged or of another kind") from None


# The largest BPE vocabulary hybridpar trains: 8x the largest of published LLMs (Gemma 3's 262,144 tokens). Past
# it the tokenizers trainer's allocations abort the process (a Rust OOM, exit 134) instead of raising.
MAX_BPE_VOCAB = 1 << 21


def bpe_size_error(n: int, what: str) -> str:
    """Why `n` is no BPE vocabulary size to train ('' when it is one), for the setting named `what`."""
    if n < 512:
        return f"{what}: give the vocabulary size, at least 512 (256 bytes + merges), e.g. 32000"
    if n > MAX_BPE_VOCAB:
        return f"{what}: {n:,} tokens is past the {MAX_BPE_VOCAB:,} hybridpar trains; give a size such as 32000"
    return ""


def train_bpe(docs: Iterable[str], vocab_size: int):
    """Train a byte-level BPE (GPT-2 style: bytes as the initial alphabet, so every text encodes), streaming."""
    from tokenizers import Tokenizer as HFModel, decoders, models, pre_tokenizers, trainers

    tok = HFModel(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs) if hasattr(docs, "__len__") else None)
    return tok


def load_tokenizer(spec: str, train_docs: list[str] | None = None, corpus_sha: str = "",
                   cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a `data.tokenizer` spec names. Raises ValueError with the fix for a bad spec."""
    if spec == "bytes":
        return ByteTokenizer()
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and arg:
        from tokenizers import Tokenizer as HFModel

        if not Path(arg).is_file():
            raise ConfigError(f"data.tokenizer={spec!r}: no such file {arg!r}; give the path of a tokenizer.json")
        return HFTokenizer(_read(spec, arg, "tokenizer.json", lambda: HFModel.from_file(arg)), spec)
    if kind == "gpt2" and arg:
        return HFTokenizer(_gpt2_bpe(arg, spec), spec)
    if kind == "sentencepiece" and arg:
        if not Path(arg).is_file():
            raise ConfigError(f"data.tokenizer={spec!r}: no such file {arg!r}; give the path of a SentencePiece .model")
        return SentencePieceTokenizer(arg, spec)
    if kind == "train-bpe":
        try:
            n = int(arg)
        except ValueError:
            n = 0
        if bpe_size_error(n, ""):
            raise ConfigError(bpe_size_error(n, f"data.tokenizer={spec!r}"))
        if train_docs is None:
            raise ConfigError(f"data.tokenizer={spec!r} trains on the built-in corpus only; for your own data run "
                             f"launch/train_tokenizer.py and pass bpe:PATH")
        from tokenizers import Tokenizer as HFModel

        path = cache_dir / f"tokenizer-bpe{n}-{corpus_sha[:16]}.json"
        if path.is_file():
            return HFTokenizer(_read(spec, path, "cached tokenizer (delete it to train again)",
                                     lambda: HFModel.from_file(str(path))), spec)
        tok = train_bpe(train_docs, n)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return HFTokenizer(tok, spec)
    raise ConfigError(f"data.tokenizer={spec!r} is not a tokenizer spec; use bytes, bpe:PATH, gpt2:DIR, "
                     f"sentencepiece:MODEL or train-bpe:N")
