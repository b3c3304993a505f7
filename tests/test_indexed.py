"""The indexed dataset format against megatron-core (both directions), the GPTDataset/blending layer, the
layout-independent sample order, and every bad-data error."""

from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest
import torch

from hybridpar.data.gpt_data import GlobalBatchLoader, PlainSamples, _megatron, build_gpt_datasets, open_blend
from hybridpar.data.stages import parse_blend
from hybridpar.data.indexed import DataError, IndexedTokens, IndexedWriter
from hybridpar.data.tokenizer import ByteTokenizer

_megatron()  # megatron.core's datasets the way hybridpar imports them (without the package's model-stack __init__)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


@pytest.fixture(autouse=True, scope="module")
def one_process_group(tmp_path_factory):
    """megatron-core's BlendedDataset asks torch.distributed for the rank, as hybridpar's launcher provides even for
    one process: a real world-size-1 gloo group."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _docs(n: int, seed: int = 0, lo: int = 3, hi: int = 250) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(lo, hi, size=int(rng.integers(1, 40))) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_hybridpar_files_read_in_megatron_core(tmp_path, dtype):
    docs = _docs(50)
    prefix = _write(tmp_path / "ours", docs, dtype)
    theirs = IndexedDataset(prefix, multimodal=False, mmap=True)
    assert len(theirs) == 50 and theirs.index.dtype == dtype
    for i, d in enumerate(docs):
        assert np.array_equal(theirs[i], d)
    assert list(theirs.document_indices) == list(range(51))


def test_megatron_core_files_read_in_hybridpar(tmp_path):
    docs = _docs(40, seed=1)
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    for d in docs:
        builder.add_item(torch.from_numpy(d))
        builder.end_document()
    builder.finalize(str(tmp_path / "theirs.idx"))
    ours = IndexedTokens(tmp_path / "theirs")
    assert len(ours) == 40 and ours.dtype == np.int32 and ours.n_tokens == sum(len(d) for d in docs)
    for i, d in enumerate(docs):
        assert np.array_equal(ours[i], d)
    # ... and they train: megatron-core's GPTDataset over them through hybridpar's checks
    sets = build_gpt_datasets(*open_blend(str(tmp_path / "theirs")), "80,20,0", (0.8, 0.2, 0.0), 16, 0, ByteTokenizer(), 256,
                              {"train": 10, "valid": 4}, tmp_path / "cache")
    sample = sets["train"][0]
    assert sample["tokens"].shape == (16,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def _tagged(tmp_path, name, n_docs, token, length=20):
    """Documents made of one token id, so every sample tells where it came from."""
    return _write(tmp_path / name, [np.full(length, token) for _ in range(n_docs)])


def test_blend_proportions_follow_the_weights(tmp_path):
    a, b = _tagged(tmp_path, "a", 200, 7), _tagged(tmp_path, "b", 200, 9)
    sets = build_gpt_datasets(*open_blend(f"0.7 {a} 0.3 {b}"), "100,1,0", (100 / 101, 1 / 101, 0.0), 8, 0, ByteTokenizer(),
                              256, {"train": 4000}, tmp_path / "cache")
    train = sets["train"]
    from_a = sum(int((train[i]["tokens"] == 7).any()) for i in range(4000))
    assert abs(from_a / 4000 - 0.7) < 0.01


def test_a_train_blend_holds_room_to_skip_and_its_first_samples_do_not_depend_on_it(tmp_path):
    """A blend built for n samples holds more (its parts' whole passes, up to the room bound), so skipped batches
    fit; its first n samples are those of megatron-core's own BlendedDataset of exactly n over the same parts (the
    size does not change the order), and no part is asked for more samples than it holds."""
    from hybridpar.data.gpt_data import BLEND_SKIP_ROOM

    a, b = _tagged(tmp_path, "a", 60, 7), _tagged(tmp_path, "b", 300, 9)
    n = 400
    train = build_gpt_datasets(*open_blend(f"0.3 {a} 0.7 {b}"), "100,1,0", (100 / 101, 1 / 101, 0.0), 8, 0,
                               ByteTokenizer(), 256, {"train": n}, tmp_path / "cache")["train"]
    assert n < len(train) <= n + max(int(n * BLEND_SKIP_ROOM[0]), BLEND_SKIP_ROOM[1])
    BlendedDataset = _megatron()[0]
    exact = BlendedDataset(train.datasets, [0.3, 0.7], n, train.config)
    assert np.array_equal(train.dataset_index[:n], exact.dataset_index)
    assert np.array_equal(train.dataset_sample_index[:n], exact.dataset_sample_index)
    for k, part in enumerate(train.datasets):  # every index the longer blend holds lies inside its part
        assert train.dataset_sample_index[train.dataset_index == k].max() < len(part)
    counts = np.bincount(train.dataset_index, minlength=2)
    assert abs(counts[0] / len(train) - 0.3) < 0.01, counts
    assert all(int((train[i]["tokens"] == (7 if train.dataset_index[i] == 0 else 9)).all()) for i in
               range(len(train) - 5, len(train)))  # the last samples read, from the part the index names


def test_splits_are_disjoint(tmp_path):
    docs = [np.full(10, 10 + i) for i in range(100)]  # document i is made of token 10 + i
    prefix = _write(tmp_path / "d", docs)
    sets = build_gpt_datasets(*open_blend(prefix), "80,20,0", (0.8, 0.2, 0.0), 8, 0, ByteTokenizer(), 256,
                              {"train": 200, "valid": 50}, tmp_path / "cache")
    seen = {name: set(torch.cat([sets[name][i]["tokens"] for i in range(n)]).tolist())
            for name, n in (("train", 200), ("valid", 50))}
    assert seen["train"] <= set(range(10, 90)) and seen["valid"] <= set(range(90, 110))
    assert not seen["train"] & seen["valid"]


def test_global_order_is_the_same_for_any_dp_and_across_a_resume(tmp_path):
    prefix = _write(tmp_path / "d", _docs(300, seed=2))
    train = build_gpt_datasets(*open_blend(prefix), "100,1,0", (100 / 101, 1 / 101, 0.0), 16, 5, ByteTokenizer(), 256,
                               {"train": 8 * 10}, tmp_path / "cache")["train"]

    def global_batch(dp, micro, step, loaders):
        return torch.cat([x for r in range(dp) for x, _ in loaders[r].microbatches(step)])

    runs = {}
    for dp, micro in ((1, 8), (2, 2), (4, 1)):
        loaders = [GlobalBatchLoader(PlainSamples(train, micro), 8, r, dp, 256, "train") for r in range(dp)]
        runs[dp] = [global_batch(dp, micro, s, loaders) for s in range(6)]
        for loader in loaders:
            loader.close()
    for dp in (2, 4):
        for s in range(6):
            assert torch.equal(runs[dp][s], runs[1][s]), (dp, s)
    # Resume at step 3 on another dp size: a fresh loader continues with exactly the same samples.
    resumed = [GlobalBatchLoader(PlainSamples(train, 4), 8, r, 2, 256, "train") for r in range(2)]
    for s in range(3, 6):
        assert torch.equal(global_batch(2, 4, s, resumed), runs[1][s])



def test_batch_crc32_covers_the_inputs_and_targets_of_the_ranks_samples(tmp_path):
    """batch_crc32 against a CRC-32 computed here: of the int64 inputs, then the targets (IGNORE_INDEX where the loss
    mask is 0), of the samples a rank holds at a step, taken from megatron-core's dataset by hand-computed index
    (step 2, dp rank 1 of 2, global batch 8: samples 20..23)."""
    import zlib

    prefix = _write(tmp_path / "d", _docs(300, seed=3))
    train = build_gpt_datasets(*open_blend(prefix), "100,1,0", (100 / 101, 1 / 101, 0.0), 16, 7, ByteTokenizer(), 256,
                               {"train": 8 * 4}, tmp_path / "cache")["train"]
    loader = GlobalBatchLoader(PlainSamples(train, 2), 8, 1, 2, 256, "train")
    try:
        loader.microbatches(2)
        got = loader.crc32[2]
    finally:
        loader.close()
    rows = [train[i] for i in range(20, 24)]
    inputs = np.stack([np.asarray(r["tokens"], dtype=np.int64) for r in rows])
    targets = np.stack([np.where(np.asarray(r["loss_mask"]) == 0, -100, np.asarray(r["labels"])).astype(np.int64)
                        for r in rows])
    assert got == zlib.crc32(targets.tobytes(), zlib.crc32(inputs.tobytes()))
    assert got != zlib.crc32(inputs.tobytes())  # the targets count: a CRC of the inputs alone would not pass

def test_bad_data_errors(tmp_path):
    good = _write(tmp_path / "good", _docs(20))
    with pytest.raises(DataError, match=r"missing.idx does not exist"):
        IndexedTokens(tmp_path / "missing")
    (tmp_path / "nobin.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    with pytest.raises(DataError, match=r"nobin.bin does not exist"):
        IndexedTokens(tmp_path / "nobin")

    def corrupt(name, edit):
        data = bytearray((tmp_path / "good.idx").read_bytes())
        edit(data)
        (tmp_path / f"{name}.idx").write_bytes(bytes(data))
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "good.bin").read_bytes())
        return tmp_path / name

    with pytest.raises(DataError, match="not a Megatron index .bad magic"):
        IndexedTokens(corrupt("magic", lambda d: d.__setitem__(slice(0, 4), b"XXXX")))
    with pytest.raises(DataError, match="index version 2"):
        IndexedTokens(corrupt("version", lambda d: d.__setitem__(slice(9, 17), struct.pack("<Q", 2))))
    with pytest.raises(DataError, match="unknown dtype code 42"):
        IndexedTokens(corrupt("dtype", lambda d: d.__setitem__(17, 42)))
    with pytest.raises(DataError, match="lists no document boundaries"):  # (megatron-core: IndexError on it)
        IndexedTokens(corrupt("nodocs", lambda d: d.__setitem__(slice(26, 34), struct.pack("<Q", 0))))
    short = tmp_path / "short"
    (tmp_path / "short.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    (tmp_path / "short.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:-10])
    with pytest.raises(DataError, match="is truncated"):
        IndexedTokens(short)

    narrow = _write(tmp_path / "narrow", _docs(20), np.uint8)
    with pytest.raises(DataError, match="stores uint8, which cannot hold the 4096 tokens"):
        IndexedTokens(narrow).check_vocab(4096, 4096)
    IndexedTokens(narrow).check_vocab(4096, 256)  # bytes fit uint8
    with pytest.raises(DataError, match=r"token id 5000 >= model.vocab_size=4096"):
        IndexedTokens(_write(tmp_path / "big", [np.array([1, 2, 5000])])).check_vocab(4096)
    with pytest.raises(DataError, match="blend weight 'x' is not a number"):
        parse_blend(f"x {good} 0.3 {good}")
    with pytest.raises(DataError, match="a blend is 'WEIGHT PREFIX"):
        parse_blend(f"0.5 {good} 0.5")
    # An empty split fails fast (megatron-core would loop forever on it).
    with pytest.raises(DataError, match="leaves the valid split of .* empty"):
        build_gpt_datasets(*open_blend(good), "98,1,1", (0.98, 0.01, 0.01), 8, 0, ByteTokenizer(), 256,
                           {"train": 10, "valid": 10}, tmp_path / "cache")


def test_index_caches_go_to_the_cache_dir_not_next_to_the_data(tmp_path):
    data_dir = tmp_path / "data"
    prefix = _write(data_dir / "d", _docs(50))
    before = sorted(p.name for p in data_dir.rglob("*"))
    build_gpt_datasets(*open_blend(prefix), "90,10,0", (0.9, 0.1, 0.0), 8, 0, ByteTokenizer(), 256, {"train": 20, "valid": 5},
                       tmp_path / "cache")
    assert sorted(p.name for p in data_dir.rglob("*")) == before
    assert any((tmp_path / "cache" / "megatron-index").glob("*/*.npy"))


def test_a_prefix_preprocessed_again_gets_fresh_index_caches(tmp_path):
    """megatron-core keys its index caches by the prefix's path: data written again under the same prefix (fewer,
    shorter documents) reused the old sample index, whose offsets run past the new file."""
    prefix = _write(tmp_path / "d", _docs(200, seed=4, hi=250))
    args = ("100,1,0", (100 / 101, 1 / 101, 0.0), 16, 0, ByteTokenizer(), 256, {"train": 40}, tmp_path / "cache")
    first = build_gpt_datasets(*open_blend(prefix), *args)["train"]
    assert len(first) >= 40 and first[39]["tokens"].shape == (16,)
    docs = _docs(60, seed=5, lo=250, hi=256)  # other ids: a stale index would show the old ones or run off the end
    _write(tmp_path / "d", docs)
    again = build_gpt_datasets(*open_blend(prefix), *args)["train"]
    seen = torch.cat([again[i]["tokens"] for i in range(40)])
    assert int(seen.min()) >= 250
    assert len(list((tmp_path / "cache" / "megatron-index").iterdir())) == 2



def test_the_index_cache_guard_checks_every_file_to_its_bound(tmp_path):
    """Each index file megatron-core caches, damaged one value past its bound, is refused on the next build with a
    one-line DataError naming the file: a train document id of the valid split (a leak that trains on validation
    text), a sample boundary at the document index's end, a token offset at its document's end, boundaries that go
    back, a shuffle id one past the samples, a blend part one past the parts, a part's sample one past its length.
    The values at the bound itself load (the guard is not stricter than megatron-core's own indexes)."""
    from hybridpar.data.index_cache import check_index_values

    a, b = _write(tmp_path / "a", _docs(120, seed=1)), _write(tmp_path / "b", _docs(60, seed=2))
    args = ("90,10,0", (0.9, 0.1, 0.0), 16, 3, ByteTokenizer(), 256, {"train": 300, "valid": 10}, tmp_path / "cache")
    plain = build_gpt_datasets(*open_blend(a), *args)["train"]
    check_index_values(plain)
    assert int(plain.document_index.max()) == 107 and len(plain.indices) == 108  # (the split: documents 0-107)

    def files(suffix):
        return sorted((tmp_path / "cache" / "megatron-index").rglob(f"*{suffix}"))

    def refused(path, edit, message, source=a):
        good = path.read_bytes()
        values = np.load(path)
        edit(values)
        np.save(path, values)
        try:
            with pytest.raises(DataError, match=message) as e:
                build_gpt_datasets(*open_blend(source), *args)
            assert str(path) in str(e.value) and "\n" not in str(e.value)
        finally:
            path.write_bytes(good)

    [doc] = files("GPTDataset-train-document_index.npy")
    [sample] = files("GPTDataset-train-sample_index.npy")
    [shuffle] = files("GPTDataset-train-shuffle_index.npy")
    n_docs, n_samples = len(plain.document_index), len(plain.sample_index)
    refused(doc, lambda v: v.__setitem__(5, 108), r"holds document ids outside \[0, 108\)")
    refused(sample, lambda v: v.__setitem__((n_samples - 1, 0), n_docs), "holds document positions outside")
    lengths = IndexedTokens(a).sequence_lengths
    refused(sample, lambda v: v.__setitem__((1, 1), lengths[plain.document_index[v[1, 0]]]),
            "a token offset past its document's end")
    refused(sample, lambda v: v.__setitem__([1, 2], v[[2, 1]]), "sample boundaries that go back")
    refused(shuffle, lambda v: v.__setitem__(0, n_samples - 1), r"holds sample ids outside \[0, ")
    # at the bounds themselves, a cache loads: the split's last document, the last sample id
    for path, edit in ((doc, lambda v: v.__setitem__(5, 107)), (shuffle, lambda v: v.__setitem__(0, n_samples - 2))):
        good = path.read_bytes()
        values = np.load(path)
        edit(values)
        np.save(path, values)
        build_gpt_datasets(*open_blend(a), *args)
        path.write_bytes(good)
    blend = build_gpt_datasets(*open_blend(f"0.5 {a} 0.5 {b}"), *args)["train"]
    check_index_values(blend)
    [parts] = files("BlendedDataset-train-dataset_index.npy")
    [picks] = files("BlendedDataset-train-dataset_sample_index.npy")
    refused(parts, lambda v: v.__setitem__(0, 2), r"holds parts outside \[0, 2\)", f"0.5 {a} 0.5 {b}")
    first = int(blend.dataset_index[0])
    refused(picks, lambda v: v.__setitem__(0, len(blend.datasets[first])), "holds samples outside",
            f"0.5 {a} 0.5 {b}")


def test_a_zero_document_index_is_refused_alone_and_in_a_blend(tmp_path):
    """An .idx of no documents (what preprocessing an input of empty records writes, with a warning): megatron-core
    would look for an epoch with tokens forever. One line names the prefix, alone or as one part of a blend."""
    empty, good = _write(tmp_path / "empty", []), _write(tmp_path / "good", _docs(50))
    for path in (empty, f"0.5 {good} 0.5 {empty}"):
        with pytest.raises(DataError, match=rf"data.path: {empty} holds no documents; preprocess some text"):
            build_gpt_datasets(*open_blend(path), "90,10,0", (0.9, 0.1, 0.0), 8, 0, ByteTokenizer(), 256,
                               {"train": 20}, tmp_path / "cache")

def test_negative_token_ids_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"token id -3 is negative"):
        _write(tmp_path / "w", [np.array([5, 6, -3, 7])], dtype=np.int32)
    prefix = _write(tmp_path / "neg", [np.array([5, 6, 4, 7]), np.array([8, 9])] * 10, dtype=np.int32)
    data = bytearray((tmp_path / "neg.bin").read_bytes())
    data[8:12] = np.array([-3], dtype=np.int32).tobytes()  # a damaged file: the third token of document 0
    (tmp_path / "neg.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"neg.bin holds token id -3: token ids are >= 0"):
        IndexedTokens(prefix).check_vocab(256, 256)


@pytest.mark.multiprocess
def test_an_index_past_the_memory_is_one_line(tmp_path, cache_dir):
    """train.steps 15,000,000 of the built-in corpus passes the sample-count bound (5.4 GiB of sample index), but
    megatron-core's document index (passes x documents, 2 x 8 bytes each while it is built) wants 10.4 GiB: under a
    5 GB address-space limit that was a MemoryError traceback. Now one line naming the split, its size and the fix,
    exit 2, no run dir."""
    import subprocess
    import sys

    from conftest import ROOT, user_env

    run_dir = tmp_path / "run"
    out = subprocess.run(["bash", "-c", f"ulimit -v 5000000; exec {sys.executable} launch/pretrain_gpt.py --train.steps "
                          f"15000000 --logging.wandb.mode disabled --data.cache_dir {cache_dir} --run.dir {run_dir}"],
                         cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-3000:]
    assert out.stderr.startswith("error: megatron-core's index of the train split (480,000,000 samples of 128 tokens "
                                 "over ") and "did not fit in memory" in out.stderr, out.stderr
    assert out.stderr.strip().endswith("lower train.steps, or add data so fewer passes are needed")
    assert not run_dir.exists()
