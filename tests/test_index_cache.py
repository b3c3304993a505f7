"""Nothing read from data.cache_dir runs code: megatron-core's index caches (numpy.load(allow_pickle=True) inside
megatron-core) are checked before it opens them, and its numpy refuses pickles (hybridpar/data/index_cache.py).

Each variant starts the launcher once to build the caches, replaces one cache file with a hostile one, and starts
the same command again: one line naming the file, exit 2, the payload never runs, no run dir written."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from conftest import launcher
from test_stages import _source_files

from hybridpar.data.index_cache import INDEX_FILES, check_index_files


class _Payload:
    """A pickle that runs a shell command when loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _args(tmp_path, run_dir, data):
    return ["--train.steps", "1", "--train.global_batch_size", "4", "--train.seq_len", "32", "--train.eval_interval",
            "0", "--train.eval_tasks", "", "--train.sample_tokens", "0", "--train.precision", "fp32",
            "--logging.wandb.mode", "disabled", "--data.tokenizer", "bytes", "--model.n_layers", "1",
            "--model.d_model", "32", "--data.cache_dir", str(tmp_path / "cache"), "--run.dir", str(run_dir), *data]


def _cache_files(tmp_path, suffix):
    return sorted((tmp_path / "cache" / "megatron-index").rglob(f"*{suffix}"))


def _start(tmp_path, name, data, capsys) -> tuple[int, str]:
    rc = launcher("pretrain_gpt").cli(_args(tmp_path, tmp_path / name, data))
    return rc, capsys.readouterr().err


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _source_files(tmp_path_factory.mktemp("sources"), n_docs=(200, 150))


# (data settings, the cache file replaced: a name suffix and which of the matching files)
VARIANTS = {
    "plain corpus, document index": (lambda web, code: ["--data.path", web], "-GPTDataset-train-document_index.npy"),
    "staged run, a pass's shuffle index": (lambda web, code: ["--data.stages", f"0: {web},2: {code}"],
                                           "-GPTDataset-train-shuffle_index.npy"),
    "blend, dataset index": (lambda web, code: ["--data.path", f"0.5 {web} 0.5 {code}"],
                             "-BlendedDataset-train-dataset_index.npy"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_pickle_in_the_index_cache_is_refused_and_never_runs(variant, sources, tmp_path, capsys):
    data, suffix = VARIANTS[variant]
    data = data(*sources)
    rc, err = _start(tmp_path, "first", data, capsys)
    assert rc == 0, err
    targets = _cache_files(tmp_path, suffix)
    assert targets, sorted(p.name for p in (tmp_path / "cache").rglob("*.npy"))
    marker = tmp_path / "payload-ran"
    targets[-1].write_bytes(pickle.dumps(_Payload(marker)))
    assert pickle.loads(targets[-1].read_bytes()) == 0 and marker.exists()  # the payload is live: it runs if loaded
    marker.unlink()
    rc, err = _start(tmp_path, "again", data, capsys)
    assert rc == 2 and not marker.exists(), err
    assert err.startswith(f"error: index cache {targets[-1]} is not an .npy array") and err.count("\n") == 1, err
    assert "delete it" in err and not (tmp_path / "again").exists()


def test_object_arrays_wrong_types_truncation_and_damaged_values_are_refused(sources, tmp_path, capsys):
    """The fourth variant: an .npy array of Python objects (its header is valid; numpy unpickles its body), then
    damage: an array of another type, a truncated file, and indexes past what they index."""
    web, _ = sources
    rc, err = _start(tmp_path, "first", ["--data.path", web], capsys)
    assert rc == 0, err
    [doc] = _cache_files(tmp_path, "-GPTDataset-train-document_index.npy")
    [sample] = _cache_files(tmp_path, "-GPTDataset-train-sample_index.npy")
    good_doc, good_sample = doc.read_bytes(), sample.read_bytes()
    marker = tmp_path / "payload-ran"
    cases = [
        (doc, lambda p: np.save(p, np.array([_Payload(marker)], dtype=object), allow_pickle=True),
         "holds dtype object, shape (1,), where megatron-core writes int32 of rank 1"),
        (doc, lambda p: np.save(p, np.zeros(5, np.float64)), "holds dtype float64, shape (5,)"),
        (sample, lambda p: np.save(p, np.zeros(8, np.int32)), "holds dtype int32, shape (8,), where megatron-core "
                                                               "writes int32/int64 of rank 2"),
        (doc, lambda p: p.write_bytes(good_doc[:-7]), "bytes, its header says"),
        (doc, lambda p: np.save(p, np.load(_copy(good_doc, tmp_path)) + 10_000),
         "holds document ids outside [0, 190)"),  # (the train split: 190 of the 200 documents)
    ]
    for path, poison, message in cases:
        poison(path)
        rc, err = _start(tmp_path, "again", ["--data.path", web], capsys)
        assert rc == 2 and message in err and str(path) in err and err.count("\n") == 1, (message, err)
        assert not marker.exists() and not (tmp_path / "again").exists()
        doc.write_bytes(good_doc)
        sample.write_bytes(good_sample)
    rc, err = _start(tmp_path, "again", ["--data.path", web], capsys)  # restored: it trains
    assert rc == 0, err


def _copy(data: bytes, tmp_path):
    path = tmp_path / "copy.npy"
    path.write_bytes(data)
    return path


def test_megatron_cores_numpy_never_unpickles(tmp_path):
    """The second guard, for a file replaced between the check and megatron-core's read: the numpy its dataset
    modules call refuses a pickle even with allow_pickle=True."""
    import sys

    from hybridpar.data.gpt_data import _megatron

    BlendedDataset, GPTDataset, *_ = _megatron()
    path, marker = tmp_path / "x-GPTDataset-train-document_index.npy", tmp_path / "payload-ran"
    path.write_bytes(pickle.dumps(_Payload(marker)))
    for cls in (BlendedDataset, GPTDataset):
        with pytest.raises(ValueError, match="pickled"):
            sys.modules[cls.__module__].numpy.load(path, allow_pickle=True, mmap_mode="r")
    assert not marker.exists()
    assert sys.modules[GPTDataset.__module__].numpy.arange(3).tolist() == [0, 1, 2]  # the rest is numpy's
    with pytest.raises(Exception, match="is not an .npy array"):
        check_index_files(tmp_path)
    assert set(INDEX_FILES) >= {"-document_index.npy", "-sample_index.npy", "-shuffle_index.npy"}


def test_damaged_builtin_corpus_and_task_caches_are_built_again(tmp_path, capsys):
    """The other files of data.cache_dir that hybridpar reads itself are JSON (nothing in them can run): the
    built-in corpus and the built-in task, derived from the interpreter, are rebuilt when damaged, saying so, to
    the same content; a damaged cached tokenizer is a one-line error (tests/test_data.py)."""
    from hybridpar.config.data import DataConfig
    from hybridpar.data.corpus import load_builtin_corpus
    from hybridpar.inference.tasks import builtin_task

    docs, sha = load_builtin_corpus(tmp_path)
    [corpus] = tmp_path.glob("corpus-builtin-*.json")
    corpus.write_text(corpus.read_text()[:1000])
    assert load_builtin_corpus(tmp_path) == (docs, sha)
    assert f"the built-in corpus cache {corpus} is damaged" in capsys.readouterr().err
    task = builtin_task("builtin:next-words", DataConfig(cache_dir=str(tmp_path)))
    [cached] = tmp_path.glob("task-next-words-*.jsonl")
    cached.write_text(cached.read_text()[:300])
    assert builtin_task("builtin:next-words", DataConfig(cache_dir=str(tmp_path))) == task
    assert f"the built-in task cache {cached} is damaged" in capsys.readouterr().err
