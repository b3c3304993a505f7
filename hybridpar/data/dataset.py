"""What the trainer needs from the data: the tokenizer, this rank's train loader, the fixed validation batches.

data.path is 'builtin' (Python's own documentation, preprocessed once into a cached .bin/.idx with the tokenizer
data.tokenizer names) or one Megatron indexed-dataset prefix, or a weighted blend of them ('0.7 pathA 0.3 pathB').
Either way the samples come from megatron-core's GPTDataset: sequences of seq_len + 1 tokens packed across
document boundaries (each document ends with the EOD token), documents and samples shuffled from the seed.

Validation is a fixed set: the first train.eval_batches x global_batch_size samples of the valid split, split over
data-parallel ranks like a training batch, so its loss is the same number for every layout.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

import numpy as np

from hybridpar.errors import ConfigError, DataError
from hybridpar.config import DataConfig
from hybridpar.data.corpus import load_builtin_corpus
from hybridpar.data.gpt_data import (BlendSamples, GlobalBatchLoader, PlainSamples, build_gpt_datasets, build_passes,
                                     check_prefixes, open_blend, rank_zero_first, release_index_readers, split_ranges)
from hybridpar.data.indexed import IndexedTokens, idx_path
from hybridpar.data.preprocess import preprocess
from hybridpar.data.stages import StagedDataset, StagePlan, StageSampler
from hybridpar.data.tokenizer import Tokenizer, load_tokenizer

UNIGRAM_MAX_TOKENS = 50_000_000  # the unigram baseline reads the data once; skip it for large corpora


def load_data_tokenizer(d: DataConfig, stages: StagePlan | None = None):
    """data.tokenizer, loaded once (hybridpar.resolve step 5). train-bpe:N learns from the train split's documents
    of the built-in corpus, and only there."""
    cache_dir = d.cache_path
    if cache_dir.exists() and not cache_dir.is_dir():
        raise ConfigError(f"data.cache_dir={d.cache_dir!r} is a file; give a directory (it holds the built corpus, "
                          f"tokenizers and index caches)")
    if d.path != "builtin" or (stages is not None and set(stages.sources) != {"builtin"}):
        if d.tokenizer.startswith("train-bpe"):
            raise ConfigError(f"data.tokenizer={d.tokenizer!r} trains on the built-in corpus only; give the tokenizer "
                              f"your data was preprocessed with (bpe:PATH, gpt2:DIR, sentencepiece:MODEL or bytes)")
        return load_tokenizer(d.tokenizer)

    def build():
        docs, sha = load_builtin_corpus(cache_dir)
        n_train = split_ranges(len(docs), d.split_fractions)[0][1]
        return load_tokenizer(d.tokenizer, docs[:n_train], sha, cache_dir)

    return rank_zero_first(build)


def prepare_builtin(d: DataConfig, tokenizer) -> tuple[str, str]:
    """The built-in corpus as an indexed dataset in the cache (built once per corpus and tokenizer); returns
    (prefix, description)."""
    cache_dir = d.cache_path
    docs, sha = load_builtin_corpus(cache_dir)
    prefix = cache_dir / f"builtin-{sha[:16]}-{tokenizer.fingerprint}"
    if not idx_path(prefix).is_file():
        # Several ranks may get here at once: each writes its own temporary files; the renames are atomic.
        tmp = prefix.with_name(f"{prefix.name}.{os.getpid()}")
        preprocess(iter(docs), d.tokenizer, tmp, tokenizer=tokenizer)
        for ext in (".bin", ".idx"):
            os.replace(f"{tmp}{ext}", f"{prefix}{ext}")
    return str(prefix), f"builtin ({len(docs)} documents, sha256 {sha[:12]})"


def unigram_loss(data: IndexedTokens, fractions, vocab_size: int) -> float:
    """Cross entropy (nats/token) of the valid split under the train split's unigram distribution (add-one
    smoothed): the loss of a model that ignores context. NaN for corpora over UNIGRAM_MAX_TOKENS."""
    if data.n_tokens > UNIGRAM_MAX_TOKENS:
        return float("nan")
    (tb, te), (vb, ve), _ = split_ranges(len(data), fractions)

    def tokens(beg, end):
        if end <= beg:
            return np.zeros(0, np.int64)
        start = int(data.sequence_pointers[beg]) // data.dtype.itemsize
        stop = int(data.sequence_pointers[end - 1]) // data.dtype.itemsize + int(data.sequence_lengths[end - 1])
        return np.asarray(data.tokens[start:stop])

    counts = np.bincount(tokens(tb, te), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    valid = tokens(vb, ve)
    return float(-logp[valid].mean()) if len(valid) else float("nan")


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train: GlobalBatchLoader
    valid: list  # this rank's fixed validation microbatches
    description: str
    unigram_loss: float
    valid_sources: dict[str, list] = field(default_factory=dict)  # a staged run's, per source (valid is their union)
    source_reads: list = field(default_factory=list)  # a blend's (prefix, samples drawn, samples a pass) per source
    prefixes: list = field(default_factory=list)  # the sources' prefixes on disk (the built-in corpus's in the cache)

    def close(self) -> None:
        self.train.close()
        release_index_readers()

    def samples_line(self, needed: int, tokens: int) -> str:
        """How many training samples exist and why: train.steps x global batch asks for `needed`; the dataset is
        built in whole passes over its split, so it holds at least that many."""
        n, per_pass = len(self.train.dataset), self.train.dataset.per_pass
        if per_pass is None:  # a blend or stages: their parts are built to their weights' shares
            reads = "".join(f"; {p}: {drawn / one:.2f} pass(es) over its {one:,}" for p, drawn, one in
                            self.source_reads if one)
            return f"{n:,} train samples of {tokens} tokens (train.steps x global batch needs {needed:,}{reads})"
        passes = -(-needed // per_pass) if per_pass else 0
        return (f"{n:,} train samples of {tokens} tokens (train.steps x global batch needs {needed:,}: {passes} "
                f"pass(es) over the split's {per_pass:,})")


def train_batches(cfg) -> int:
    """Global batches the train split is built for: train.steps, and with train.spike=rewind the batches its rewinds
    may skip (spike.max_rewinds x spike.skip). The count decides megatron-core's sample order, as train.steps does
    (docs/data.md): turning rewinds on or changing those two builds another order."""
    t, s = cfg.train, cfg.spike
    return t.steps + (s.max_rewinds * s.skip if t.spike == "rewind" else 0)


# megatron-core builds each split's sample index in memory (about 12 bytes a sample: the sample and shuffle
# indexes) before the first step; past this a run is refused at once instead of allocating for minutes or looping
# in megatron-core's epoch count (train.steps 1e8 x batch 32 wanted 6.8 GiB and then raised MemoryError).
SAMPLE_INDEX_BYTES, SAMPLE_INDEX_LIMIT = 12, 8 * 2**30


def check_sample_count(cfg) -> None:
    """The train split's sample count (train.steps and the batches rewinds may skip, times the global batch) against
    what its index may take; the refusal names the setting that made it large."""
    t, s = cfg.train, cfg.spike
    batches = train_batches(cfg)
    samples = batches * t.global_batch_size
    if samples * SAMPLE_INDEX_BYTES <= SAMPLE_INDEX_LIMIT:
        return
    most = SAMPLE_INDEX_LIMIT // SAMPLE_INDEX_BYTES // t.global_batch_size
    reserve = batches - t.steps
    what = (f"train.steps={t.steps} + spike.max_rewinds={s.max_rewinds} x spike.skip={s.skip} (the batches rewinds "
            f"may skip)" if reserve else f"train.steps={t.steps}")
    if reserve > t.steps and most > t.steps:  # the rewinds' reserve made it large
        fix = f"lower spike.max_rewinds x spike.skip to {most - t.steps} or less"
    elif most > reserve:
        fix = f"use --train.steps {most - reserve} or fewer"
    else:
        fix = "lower spike.max_rewinds x spike.skip and train.steps"
    raise ConfigError(f"{what} = {batches:,} batches x train.global_batch_size={t.global_batch_size} = {samples:,} "
                      f"samples, whose index would take {samples * SAMPLE_INDEX_BYTES / 2**30:,.1f} GiB of every "
                      f"rank's memory (at most {SAMPLE_INDEX_LIMIT / 2**30:.0f} GiB); {fix}")


# Validation is a fixed set read into memory at start (validation_batches): its inputs and
# targets, int64, at every evaluation. Past this it is minutes of silent reading before step 1.
EVAL_SET_LIMIT = 2 * 2**30


def check_eval_size(cfg) -> None:
    t = cfg.train
    if not t.eval_interval:
        return
    per_batch = t.global_batch_size * t.seq_len * 2 * 8  # (spread over the data-parallel ranks; bounded as a whole)
    if t.eval_batches * per_batch > EVAL_SET_LIMIT:
        raise ConfigError(f"train.eval_batches={t.eval_batches:,} x train.global_batch_size={t.global_batch_size} x "
                          f"train.seq_len={t.seq_len} is a validation set of {t.eval_batches * per_batch / 2**30:,.1f} "
                          f"GiB held in memory and read at every evaluation; use --train.eval_batches "
                          f"{EVAL_SET_LIMIT // per_batch} or fewer")


def build_training_data(cfg, tokenizer, stages, dp_rank: int, dp_size: int, pin: bool = False) -> TrainingData:
    """The data of a resolved config (its tokenizer, and its StagePlan or None: hybridpar.resolve.Run's), in one
    straight flow: the indexed files (the built-in corpus built into the cache first), each opened and checked once
    -> the blend and splits, parsed once -> megatron-core's sample order -> this rank's loaders (pin: their batches
    in pinned memory, for a GPU)."""
    d, t, vocab = cfg.data, cfg.train, cfg.model.vocab_size
    if stages is not None:
        return _staged_training_data(cfg, tokenizer, stages, dp_rank, dp_size, pin)
    if d.path == "builtin":
        path, description = rank_zero_first(lambda: prepare_builtin(d, tokenizer))
    else:
        path, description = d.path, None
    blend, indexes = open_blend(path)
    if description is None:
        description = " + ".join(f"{w:.2f} x {p}" for w, p in blend) if len(blend) > 1 else path
    n_valid = t.eval_batches * t.global_batch_size
    sets = build_gpt_datasets(blend, indexes, d.split, d.split_fractions, t.seq_len, t.seed, tokenizer, vocab,
                              {"train": train_batches(cfg) * t.global_batch_size, "valid": n_valid},
                              d.cache_path)
    ds = sets["train"]  # one GPTDataset (one pass = the split's tokens / seq_len), or a blend built to its shares
    per_pass = _per_pass(ds) if len(blend) == 1 else None
    needed = (t.steps + sum(b - a + 1 for a, b in d.skip_windows)) * t.global_batch_size  # (a fresh run's skips)
    reads = _source_reads(ds, blend, needed)
    over = [(p, drawn, one) for p, drawn, one in reads if drawn > one]
    if over and d.source_exhausted == "stop":
        p, drawn, one = over[0]
        raise DataError(f"data.path reads {p} past its one pass ({one:,} train samples, {drawn:,} drawn in "
                        f"train.steps={t.steps}) with data.source_exhausted stop; add data, lower its weight, train "
                        f"fewer steps, or pass --data.source_exhausted wrap")
    samples = (PlainSamples if len(blend) == 1 else BlendSamples)(ds, t.micro_batch_size, per_pass)
    train = GlobalBatchLoader(samples, t.global_batch_size, dp_rank, dp_size, vocab, "train", pin_memory=pin)
    valid = _valid_batches(sets["valid"], t, dp_rank, dp_size, vocab)
    unigram = (unigram_loss(indexes[blend[0][1]], d.split_fractions, tokenizer.vocab_size) if len(blend) == 1
               else float("nan"))
    return TrainingData(tokenizer, train, valid, description, unigram, source_reads=reads if len(blend) > 1 else [],
                        prefixes=[p for _, p in blend])


def _per_pass(ds) -> int:
    """Samples one pass over a megatron-core GPTDataset's split holds."""
    return int(ds.dataset.sequence_lengths[ds.indices].sum()) // ds.config.sequence_length


def _source_reads(ds, blend, needed: int) -> list[tuple[str, int, int]]:
    """(prefix, samples the first `needed` samples draw from it, samples one pass over its split holds) of each
    source of a plain source or blend."""
    if len(blend) == 1:
        return [(blend[0][1], needed, _per_pass(ds))]
    counts = np.bincount(np.asarray(ds.dataset_index[:needed]), minlength=len(blend))
    return [(prefix, int(c), _per_pass(part)) for (_, prefix), part, c in zip(blend, ds.datasets, counts)]


def _valid_batches(dataset, t, dp_rank: int, dp_size: int, vocab: int) -> list:
    """This rank's share of the first train.eval_batches global batches of a validation dataset ([] when
    validation is off)."""
    if not t.eval_interval:
        return []
    loader = GlobalBatchLoader(PlainSamples(dataset, t.micro_batch_size), t.global_batch_size, dp_rank, dp_size, vocab,
                               "valid", prefetch=0)
    batches = [mb for k in range(t.eval_batches) for mb in loader.load(k)]
    loader.close()
    return batches


def source_names(prefixes) -> list[str]:
    """Short names of stage sources for metrics (the prefix's file name; the whole prefix where two share one)."""
    short = [os.path.basename(p) or p for p in prefixes]
    return [s if short.count(s) == 1 else p for s, p in zip(short, prefixes)]


# Every pass of a stream is a megatron-core GPTDataset built at start: 4 cache files (document, sample and shuffle
# index, description) and about 5 open files while the run lasts (the index memory maps and the source's .bin/.idx).
# A 5M-step run over a small source wanted thousands and died of "Too many open files" after writing 26,707 files.
MAX_PASSES, FILES_OPEN_PER_PASS, FILES_OPEN_OTHERWISE = 256, 5, 256


def check_pass_count(streams, needs: list[int], per_pass: list[int], drawn: list[int], n_batches: int) -> None:
    """Refuses a staged run whose streams need more passes than a process can hold open (RLIMIT_NOFILE) or than
    MAX_PASSES, naming the stream that needs the most and what would bring the count down."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    fd_bound = (soft - FILES_OPEN_OTHERWISE) // FILES_OPEN_PER_PASS if soft != resource.RLIM_INFINITY else MAX_PASSES
    most = max(1, min(MAX_PASSES, fd_bound))
    if sum(needs) <= most:
        return
    s = max(range(len(needs)), key=needs.__getitem__)
    (prefix, length), other = streams[s], sum(needs) - needs[s]
    limit = (f"at most {most}: {FILES_OPEN_PER_PASS} open files a pass under this shell's `ulimit -n` {soft}"
             if fd_bound < MAX_PASSES else f"at most {MAX_PASSES}")
    raise DataError(f"data.stages: {n_batches:,} batches read {prefix} (seq {length}) {needs[s]:,} times over "
                    f"({drawn[s]:,} samples drawn, {per_pass[s]:,} a pass), {sum(needs):,} passes in all, each built "
                    f"at start ({limit}); add data to it, lower its weight, or train fewer steps"
                    + (f" (the other streams need {other:,})" if other else ""))


def _staged_training_data(cfg, tokenizer, plan, dp_rank: int, dp_size: int, pin: bool) -> TrainingData:
    """The data of a run with data.stages (hybridpar.data.stages): every source opened and checked once, each
    stream's first pass (and each source's validation samples, at train.seq_len) built, the draws of the whole run
    counted to know how many passes each stream needs (data.source_exhausted: wrap builds them, stop refuses the
    run), then the position-keyed loader."""
    d, t, vocab, G = cfg.data, cfg.train, cfg.model.vocab_size, cfg.train.global_batch_size
    builtin = rank_zero_first(lambda: prepare_builtin(d, tokenizer))[0] if "builtin" in plan.sources else None
    path = {p: builtin if p == "builtin" else p for p in plan.sources}
    indexes = {p: IndexedTokens(p) for p in path.values()}
    check_prefixes(list(indexes), indexes, d.split, d.split_fractions, tokenizer, vocab, ("train", "valid"))
    split = (d.split, d.split_fractions)
    streams = [build_passes(path[p], range(1), *split, length, t.seed, tokenizer, d.cache_path)[0]
               for p, length in plan.streams]
    sampler = StageSampler(plan, t.seed, G)
    # A staged order is keyed by position, whatever the run's length: the batches data.skip_batches skips are added
    # (without them a staged run could skip none: the split ended at train.steps).
    n_batches = train_batches(cfg) + sum(b - a + 1 for a, b in d.skip_windows)
    drawn = sampler.counts_before(n_batches)
    needs = [-(-int(n) // len(passes[0])) for n, passes in zip(drawn, streams)]
    for s, ((prefix, length), passes) in enumerate(zip(plan.streams, streams)):
        per_pass = len(passes[0])
        if needs[s] > 1 and d.source_exhausted == "stop":
            batch = next(b for b in range(n_batches + 1) if sampler.counts_before(b)[s] > per_pass)
            raise DataError(f"data.stages read {prefix} (seq {length}) past its one pass ({per_pass:,} train samples) "
                            f"at batch {batch} of {n_batches} ({int(drawn[s]):,} drawn in all); add data, lower its "
                            f"weight, or pass --data.source_exhausted wrap")
    check_pass_count(plan.streams, needs, [len(p[0]) for p in streams], [int(n) for n in drawn], n_batches)
    for s, ((prefix, length), passes) in enumerate(zip(plan.streams, streams)):
        passes += build_passes(path[prefix], range(1, needs[s]), *split, length, t.seed, tokenizer,
                               d.cache_path)[0]
    names = source_names(plan.sources)
    dataset = StagedDataset(sampler, streams, n_batches * G, names, t.micro_batch_size, t.seq_len,
                            [str(path[p]) for p, _ in plan.streams])
    train = GlobalBatchLoader(dataset, G, dp_rank, dp_size, vocab, "train", pin_memory=pin)
    n_valid = t.eval_batches * G if t.eval_interval else 0
    valid_sources = {n: _valid_batches(build_passes(path[p], range(0), *split, t.seq_len, t.seed, tokenizer,
                                                    d.cache_path, n_valid)[1], t, dp_rank, dp_size, vocab)
                     for n, p in zip(names, plan.sources)} if n_valid else {}
    valid = [mb for batches in valid_sources.values() for mb in batches]
    description = (f"{len(plan.stages)} stage(s) over {len(names)} source(s) ({', '.join(names)}; passes built per "
                   f"stream: {', '.join(str(len(p)) for p in streams)})")
    return TrainingData(tokenizer, train, valid, description, float("nan"), valid_sources,
                        prefixes=list(dict.fromkeys(path.values())))
