"""Data: tokenizers (bytes, BPE, GPT-2 files, SentencePiece), the built-in corpus, and the preprocessing and
tokenizer-training tools as a user runs them."""

from __future__ import annotations

import gzip
import json

import pytest

from conftest import launcher, run_cli
from hybridpar.config.cli import load_config
from hybridpar.data.corpus import load_builtin_corpus
from hybridpar.data.dataset import load_data_tokenizer, prepare_builtin, unigram_loss
from hybridpar.resolve import vocab_size_for
from hybridpar.data.indexed import IndexedTokens
from hybridpar.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe

TEXTS = ["The model trains on tokens.", "Données: naïve café — ok", "def f(x):\n    return x + 1\n", "a"]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "small.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i in range(60):
            f.write(json.dumps({"id": i, "text": TEXTS[i % len(TEXTS)] * (1 + i % 3)}) + "\n")
    return path


def _docs_of(prefix, tokenizer):
    data = IndexedTokens(prefix)
    return [tokenizer.decode(data[i][:-1].tolist()) for i in range(len(data))], [int(data[i][-1]) for i in range(len(data))]


def test_byte_tokenizer_roundtrip():
    tok = ByteTokenizer()
    text = "naïve café — ok"
    assert tok.decode(tok.encode(text)) == text and max(tok.encode(text)) < 256


def test_builtin_corpus_preprocessed_with_the_trained_bpe(cache_dir):
    cfg = load_config(["--data.cache_dir", str(cache_dir)])
    tok = load_data_tokenizer(cfg.data)
    prefix, description = prepare_builtin(cfg.data, tok)
    assert tok.vocab_size == 4096 and "documents" in description
    data = IndexedTokens(prefix)
    docs, _ = load_builtin_corpus(cache_dir)
    assert len(data) == len(docs) > 3000 and data.n_tokens > 400_000
    assert tok.decode(data[5][:-1].tolist()) == docs[5] and int(data[5][-1]) == tok.eod_id
    text = "Return the number of items in a container."
    assert len(tok.encode(text)) < len(text) / 2.5  # a BPE trained on this text compresses it
    assert 5.5 < unigram_loss(data, cfg.data.split_fractions, tok.vocab_size) < 8.0
    assert prepare_builtin(cfg.data, tok)[0] == prefix  # cached


def test_gpt2_files_and_sentencepiece_load_offline(tmp_path):
    docs, _ = load_builtin_corpus_small()
    bpe = train_bpe(docs, 600)
    bpe.model.save(str(tmp_path))  # vocab.json + merges.txt, the layout of GPT-2's files
    gpt2 = load_tokenizer(f"gpt2:{tmp_path}")
    for text in TEXTS[:3]:
        assert gpt2.encode(text) == bpe.encode(text).ids and gpt2.decode(gpt2.encode(text)) == text
    (tmp_path / "vocab.json").rename(tmp_path / "encoder.json")
    (tmp_path / "merges.txt").rename(tmp_path / "vocab.bpe")
    assert load_tokenizer(f"gpt2:{tmp_path}").encode(TEXTS[0]) == bpe.encode(TEXTS[0]).ids

    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    sp = load_tokenizer(f"sentencepiece:{tmp_path / 'sp.model'}")
    assert sp.vocab_size == 200 and sp.decode(sp.encode(TEXTS[0])) == TEXTS[0] and sp.eod_id == 2
    (tmp_path / "run").mkdir()
    sp.save(tmp_path / "run")  # saved with the run and its checkpoints
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == (tmp_path / "sp.model").read_bytes()


def load_builtin_corpus_small():
    docs = [t * k for t in TEXTS for k in range(1, 30)]
    docs += ["the quick brown fox jumps over the lazy dog " * 3, "import numpy as np\nx = np.zeros(3)\n"] * 20
    return docs, ""


def test_tokenizer_spec_errors(tmp_path):
    for spec, message in [("sentencepiece", "is not a tokenizer spec"), ("train-bpe:10", "at least 512"),
                          ("train-bpe:99999999999", "99,999,999,999 tokens is past the 2,097,152 hybridpar trains"),
                          (f"gpt2:{tmp_path}", "holds neither vocab.json"), ("bpe:/nope.json", "no such file"),
                          ("sentencepiece:/nope.model", "no such file")]:
        with pytest.raises(ValueError, match=message):
            load_tokenizer(spec, [], "", tmp_path)



def test_train_tokenizer_refuses_a_vocabulary_it_cannot_train_and_a_directory(tmp_path, jsonl, capsys):
    """A size past MAX_BPE_VOCAB aborted the tokenizers trainer (a Rust OOM, exit 134); a directory as --output
    trained, then failed in Rust. Both are one line before any training, nothing written."""
    train_tokenizer = launcher("train_tokenizer")
    (tmp_path / "out").mkdir()
    for argv, message in [(["--vocab-size", "99999999999", "--output", str(tmp_path / "t.json")],
                           "error: --vocab-size 99999999999: 99,999,999,999 tokens is past the 2,097,152 hybridpar "
                           "trains; give a size such as 32000"),
                          (["--vocab-size", "600", "--output", str(tmp_path / "out"), "--overwrite"],
                           f"error: --output {tmp_path / 'out'} is a directory; name the tokenizer.json file to write")]:
        assert train_tokenizer.cli(["--input", str(jsonl), *argv]) == 2
        out, err = capsys.readouterr()
        assert err.strip() == message and out == ""
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and not any((tmp_path / "out").iterdir())


def test_damaged_tokenizer_files_are_one_line_errors(tmp_path):
    """Truncated and foreign tokenizer files of each kind, read as training and preprocessing read them."""
    import sentencepiece as spm

    from hybridpar.errors import ConfigError

    docs, _ = load_builtin_corpus_small()
    bpe = train_bpe(docs, 600)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "gpt2").mkdir()
    bpe.model.save(str(tmp_path / "gpt2"))
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2)
    cases = []
    for name, spec, what in [("tokenizer.json", "bpe:{}", "tokenizer.json"), ("sp.model", "sentencepiece:{}",
                             "SentencePiece .model"), ("gpt2/vocab.json", "gpt2:{}", "GPT-2's vocab.json")]:
        good = (tmp_path / name).read_bytes()
        for damage, content in [("truncated", good[:len(good) // 2]), ("foreign", b"\x89PNG\r\n\x1a\n" + good[8:]),
                                ("empty", b"")]:
            (tmp_path / name).write_bytes(content)
            target = tmp_path / ("gpt2" if name.startswith("gpt2") else name)
            with pytest.raises(ConfigError, match=rf"is not a valid {what}") as e:
                load_tokenizer(spec.format(target))
            assert "\n" not in str(e.value)
            cases.append((name, damage))
        (tmp_path / name).write_bytes(good)
    assert len(cases) == 9


def test_a_tokenizer_without_an_end_of_document_token_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hybridpar.errors import ConfigError

    docs, _ = load_builtin_corpus_small()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "noeod.json"))
    with pytest.raises(ConfigError, match="has no end-of-document token"):
        load_tokenizer(f"bpe:{tmp_path / 'noeod.json'}")
    tok.add_special_tokens(["</s>"])  # a Llama-2 style end of document is taken
    tok.save(str(tmp_path / "s.json"))
    assert load_tokenizer(f"bpe:{tmp_path / 's.json'}").eod_id == tok.token_to_id("</s>")

    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(tmp_path / "sp"), vocab_size=200,
                                   model_type="bpe", minloglevel=2, eos_id=-1)
    with pytest.raises(ConfigError, match="has no EOS piece"):
        load_tokenizer(f"sentencepiece:{tmp_path / 'sp.model'}")


def test_an_end_of_document_text_inside_a_document_does_not_split_it(tmp_path):
    from hybridpar.data.indexed import DataError
    from hybridpar.data.preprocess import iter_documents, preprocess

    docs, _ = load_builtin_corpus_small()
    train_bpe(docs, 600).save(str(tmp_path / "tokenizer.json"))
    spec = f"bpe:{tmp_path / 'tokenizer.json'}"
    texts = ["a story <|endoftext|> that goes on", "next"]
    summary = preprocess(iter(texts), spec, tmp_path / "out")
    tok = load_tokenizer(spec)
    got, eods = _docs_of(tmp_path / "out", tok)
    assert summary.documents == 2 and got == texts and eods == [tok.eod_id] * 2  # one EOD each, at the end
    with pytest.raises(DataError, match=r"document 2 \(in input order\) holds the end-of-document token 0"):
        preprocess(iter(["fine", "a NUL \x00 inside"]), "bytes", tmp_path / "nul")
    (tmp_path / "arr.jsonl").write_text(json.dumps([{"text": "a"}, {"text": "b"}]) + "\n")
    (tmp_path / "pretty.json").write_text(json.dumps([{"text": "a"}], indent=2))
    (tmp_path / "scalars.jsonl").write_text('{"text": "ok"}\n7\n')
    (tmp_path / "null.jsonl").write_text("null\n")
    for name, message in [("arr.jsonl", r"arr.jsonl:1 is a JSON array, not an object"),
                          ("scalars.jsonl", r"scalars.jsonl:2 is a JSON number, not an object"),
                          ("null.jsonl", r"null.jsonl:1 is a JSON null, not an object"),
                          ("pretty.json", r"pretty.json:1 is not valid JSON .* jq -c '.\[\]' FILE > FILE.jsonl")]:
        with pytest.raises(DataError, match=message):
            list(iter_documents([tmp_path / name]))

def test_vocab_padding_rule():
    tok = lambda n: type("T", (), {"vocab_size": n, "spec": "x"})()  # noqa: E731
    # not given: the tokenizer's size padded up to vocab_multiple, whatever the layout (hand-computed: 50257 -> 393 x
    # 128 = 50304; the old rule, vocab_multiple x tp, gave 50432 at tp 2 and 4224 for 4097 tokens at tp 3)
    for argv, n, want in [([], 50257, 50304), ([], 4096, 4096), ([], 4097, 4224),
                          (["--model.vocab_multiple", "1"], 50257, 50257), (["--model.vocab_multiple", "64"], 1000, 1024)]:
        assert vocab_size_for(load_config(argv), tok(n)) == want, (argv, n)
    # given: used as given (tp need not divide it), refused when smaller than the tokenizer's
    assert vocab_size_for(load_config(["--model.vocab_size", "5000"]), tok(4096)) == 5000
    assert vocab_size_for(load_config(["--model.vocab_size", "4161", "--parallel.tp", "2"]), tok(4096)) == 4161
    with pytest.raises(ValueError, match="has 5000 tokens but model.vocab_size=4096; set --model.vocab_size 5120"):
        vocab_size_for(load_config(["--model.vocab_size", "4096"]), tok(5000))


@pytest.mark.multiprocess
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_preprocess_jsonl(tmp_path, jsonl, tokenizer):
    if tokenizer == "bpe":
        out = run_cli(["launch/train_tokenizer.py", "--input", str(jsonl), "--vocab-size", "600", "--output",
                       str(tmp_path / "tok.json")])
        assert out.returncode == 0, out.stderr
        spec = f"bpe:{tmp_path / 'tok.json'}"
    else:
        spec = "bytes"
    out = run_cli(["launch/preprocess_data.py", "--input", str(jsonl), "--tokenizer", spec, "--output-prefix",
                   str(tmp_path / "out" / "small"), "--workers", "2"])
    assert out.returncode == 0, out.stderr
    assert "60 documents" in out.stdout and "tokens/s" in out.stdout
    tok = load_tokenizer(spec)
    docs, eods = _docs_of(tmp_path / "out" / "small", tok)
    with gzip.open(jsonl, "rt") as f:
        want = [json.loads(line)["text"] for line in f]
    assert docs == want and set(eods) == {tok.eod_id}
    if tokenizer == "bpe":
        assert IndexedTokens(tmp_path / "out" / "small").n_tokens < sum(len(w.encode()) for w in want)


@pytest.mark.multiprocess
def test_preprocess_plain_text_blank_line_blocks(tmp_path):
    (tmp_path / "a.txt").write_text("first block\nstill first\n\nsecond block\n\n\nthird\n")
    out = run_cli(["launch/preprocess_data.py", "--input", str(tmp_path / "a.txt"), "--tokenizer", "bytes",
                   "--output-prefix", str(tmp_path / "t"), "--blank-line-docs", "--no-append-eod"])
    assert out.returncode == 0, out.stderr
    data = IndexedTokens(tmp_path / "t")
    assert [bytes(data[i].tolist()).decode() for i in range(len(data))] == [
        "first block\nstill first\n", "second block\n", "third\n"]


@pytest.mark.parametrize("args, message", [
    (["--json-key", "body"], "has no key 'body' (it has ['id', 'text']); pass --json-key with the key"),
    (["--tokenizer", "train-bpe:1000"], "train a tokenizer first with launch/train_tokenizer.py"),
    (["--workers", "0"], "--workers 0: give at least 1"),
])
@pytest.mark.multiprocess
def test_preprocess_errors_are_one_line_and_write_nothing(tmp_path, jsonl, args, message):
    argv = ["launch/preprocess_data.py", "--input", str(jsonl), "--tokenizer", "bytes", "--output-prefix",
            str(tmp_path / "x"), *args]
    out = run_cli(argv)
    assert out.returncode == 2 and out.stderr.strip().startswith("error:") and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []



@pytest.mark.multiprocess
def test_a_damaged_tokenizer_stops_training_and_preprocessing_with_one_line(tmp_path, jsonl):
    (tmp_path / "tok.json").write_text('{"model": {"type": "BPE", "vocab": {')  # cut off mid-file
    spec = f"bpe:{tmp_path / 'tok.json'}"
    for argv in (["launch/pretrain_gpt.py", "--data.tokenizer", spec, "--run.dir", str(tmp_path / "run")],
                 ["launch/preprocess_data.py", "--input", str(jsonl), "--tokenizer", spec, "--output-prefix",
                  str(tmp_path / "x")]):
        out = run_cli(argv)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "tok.json is not a valid tokenizer.json (EOF while parsing" in out.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.json"]


def test_a_document_past_the_size_limit_is_refused_before_tokenizing(tmp_path):
    """A 2.5 MB JSON line and a 2.5 MB blank-line block against a 1 MB limit (100 MB lines under a memory limit
    ended the process silently and left PREFIX.bin.tmp): one error naming the file and line, nothing written."""
    from hybridpar.data.indexed import DataError
    from hybridpar.data.preprocess import iter_documents, preprocess

    big = "word " * 500_000
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", "b", big, "c"]))
    (tmp_path / "in.txt").write_text("small block\n\n" + (big + "\n") + "\nafter\n")
    for name, line in [("in.jsonl", 3), ("in.txt", 3)]:
        with pytest.raises(DataError, match=rf"{name}:{line}: a document of 2.5 MB, past --max-document-mb 1 "):
            preprocess(iter_documents([tmp_path / name], blank_line_docs=True, max_mb=1), "bytes", tmp_path / "out")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "in.txt"]
    assert len(list(iter_documents([tmp_path / "in.jsonl"], max_mb=3))) == 4  # under the limit: read

@pytest.mark.multiprocess
def test_preprocess_refuses_to_overwrite(tmp_path, jsonl):
    argv = ["launch/preprocess_data.py", "--input", str(jsonl), "--tokenizer", "bytes", "--output-prefix",
            str(tmp_path / "x")]
    assert run_cli(argv).returncode == 0
    before = (tmp_path / "x.bin").stat().st_mtime_ns
    out = run_cli(argv)
    assert out.returncode == 2 and "already exist; pass --overwrite" in out.stderr
    assert (tmp_path / "x.bin").stat().st_mtime_ns == before


@pytest.mark.multiprocess
def test_preprocess_reads_zstd_jsonl(tmp_path):
    import zstandard

    lines = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    out = run_cli(["launch/preprocess_data.py", "--input", str(tmp_path / "c.jsonl.zst"), "--tokenizer", "bytes",
                   "--output-prefix", str(tmp_path / "z")])
    assert out.returncode == 0, out.stderr
    assert _docs_of(tmp_path / "z", ByteTokenizer())[0] == TEXTS
