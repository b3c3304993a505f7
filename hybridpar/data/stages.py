"""Data stages: a mixture of sources that changes during a run (data.stages), exact, resumable and layout-free.

A stage is 'START[ ramp R][ seq L]: BLEND': from global batch START (or sample START with an 's' suffix, so a
boundary can fall inside a global batch) the sources are drawn with BLEND's weights ('W1 PREFIX1 W2 PREFIX2 ...' or
one PREFIX, the data.path syntax; 'builtin' names the built-in corpus). With 'ramp R' the weights move linearly from
the previous stage's to this one's over the R batches (or samples) after START. With 'seq L' the stage trains
sequences of L tokens (default train.seq_len): a stage that changes the length starts on a global batch boundary,
without a ramp, and its micro-batch holds train.micro_batch_size x train.seq_len / L sequences (rounded down to a
divisor of the rank's share of the batch, at least 1), so a microbatch keeps about the same number of tokens.

The draws are over streams: a source at one sequence length. A source read at a new length is a stream of its own,
with its own order from its first sample (megatron-core packs samples for one length): its documents can be seen
again at the new length.

The rule, for train sample position p (0-based, counted over the whole run: global batch b holds [bG, (b+1)G)):
  1. w(p): the weights of the last stage with start <= p; inside its ramp, (1 - f) w_prev + f w_stage with
     f = (p - start) / ramp.
  2. u(p) = splitmix64(p + (seed + 1) * 0x9E3779B97F4A7C15 mod 2^64) >> 11, divided by 2^53: uniform in [0, 1).
  3. stream(p) = the first stream whose cumulative weight exceeds u(p) (inverse CDF, streams in order of first
     appearance in data.stages; a stage gives weight only to the streams of its own length).
  4. The sample read is the next unread one of that stream: its n-th, n = #{q < p : stream(q) = stream(p)}.
So the sample at p is a pure function of (seed, stages, p): the data-parallel size, restarts and train.steps do not
enter. Each stream reads its source's train split in megatron-core's GPTDataset order, one pass (one epoch of its
documents) at a time: pass e is shuffled with seed + 7919 e, so a stream's own order never depends on the stages, on
its weights or on the run's length. A stream read past its first pass wraps into the next
(data.source_exhausted=wrap) or stops the run at start, naming it (stop).

A change of stages on resume (checkpoint.allow_data_change) keeps every source's position: the new rule applies
from the resume batch b0 on, step 4 counting from each source's count at b0 under the old rule (the origin, saved
in the trainer state of later checkpoints). Positions before an origin are not defined by the new stages.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from dataclasses import dataclass

import numpy as np

from hybridpar.data.indexed import DataError
from hybridpar.errors import ConfigError

GOLDEN = 0x9E3779B97F4A7C15
PASS_SEED_STRIDE = 7919  # pass e of a source is megatron-core's epoch order for seed + 7919 e
CHUNK_SAMPLES = 1 << 20  # positions drawn per numpy chunk when counting (about 50 MB of temporaries)
_STAGE = re.compile(r"\s*(\d+)(s?)(?:\s+ramp\s+(\d+)(s?))?(?:\s+seq\s+(\d+))?\s*:\s*(.+?)\s*$")


@dataclass(frozen=True)
class Stage:
    start: int  # first sample position
    ramp: int  # samples over which the weights move from the previous stage's (0: at once)
    seq_len: int  # tokens per sequence
    weights: tuple[float, ...]  # one per stream of the run (StagePlan.streams), normalised


@dataclass(frozen=True)
class StageText:
    """One data.stages entry, parsed: start and ramp as (number, in samples?), seq_len (None: train.seq_len), the
    blend as (weight, prefix)."""
    start: tuple[int, bool]
    ramp: tuple[int, bool]
    seq_len: int | None
    blend: tuple[tuple[float, str], ...]


def parse_blend(path: str) -> list[tuple[float, str]]:
    """'PREFIX' or 'W1 PREFIX1 W2 PREFIX2 ...' -> [(normalised weight, prefix)]."""
    parts = path.split()
    if len(parts) == 1:
        return [(1.0, parts[0])]
    if len(parts) % 2:
        raise DataError(f"data.path={path!r}: a blend is 'WEIGHT PREFIX WEIGHT PREFIX ...', e.g. "
                        f"'0.7 /data/web 0.3 /data/code'")
    pairs = []
    for w, prefix in zip(parts[::2], parts[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"data.path={path!r}: blend weight {w!r} is not a number; write e.g. "
                            f"'0.7 /data/web 0.3 /data/code'") from None
        if not weight > 0 or math.isinf(weight):
            raise DataError(f"data.path={path!r}: blend weight {w} must be a positive number")
        pairs.append((weight, prefix))
    seen = [p for _, p in pairs]
    twice = next((p for p in seen if seen.count(p) > 1), None)
    if twice is not None:  # one rule for data.path and every stage: a source is named once, with its whole weight
        added = sum(w for w, p in pairs if p == twice)
        raise DataError(f"data.path={path!r} names {twice} twice; name it once with the weights added ({added:g})")
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def parse_stage(text: str) -> StageText:
    """'START[ ramp R][ seq L]: BLEND' -> StageText; a one-line DataError naming the entry otherwise."""
    m = _STAGE.fullmatch(str(text))
    if m is None:
        raise DataError(f"data.stages entry {text!r}: write 'START[ ramp R][ seq L]: BLEND', START and R in global batches "
                        f"(or samples with an 's' suffix), e.g. '0: 0.7 /data/web 0.3 /data/code' or "
                        f"'2000 ramp 500: /data/code'")
    try:
        blend = parse_blend(m[6])
    except DataError as e:
        raise DataError(f"data.stages entry {text!r}: {str(e).replace('data.path=', 'blend ')}") from None
    if m[5] is not None and int(m[5]) < 1:
        raise DataError(f"data.stages entry {text!r}: seq {m[5]} must be >= 1")
    return StageText((int(m[1]), bool(m[2])), (int(m[3] or 0), bool(m[4])), int(m[5]) if m[5] else None, tuple(blend))


@dataclass(frozen=True)
class StagePlan:
    """data.stages resolved for a global batch size and train.seq_len: the streams ((prefix, seq_len) pairs, in
    order of first appearance) and the stages."""
    streams: tuple[tuple[str, int], ...]
    stages: tuple[Stage, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for p, _ in self.streams))

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return tuple(sorted({s.seq_len for s in self.stages}))

    @classmethod
    def parse(cls, texts, global_batch: int, seq_len: int) -> "StagePlan":
        parsed = [parse_stage(t) for t in texts]
        streams = tuple(dict.fromkeys((p, s.seq_len or seq_len) for s in parsed for _, p in s.blend))
        stages, prev = [], None
        for text, s in zip(texts, parsed):
            start = s.start[0] if s.start[1] else s.start[0] * global_batch
            ramp = s.ramp[0] if s.ramp[1] else s.ramp[0] * global_batch
            length = s.seq_len or seq_len
            weights = {(p, length): w for w, p in s.blend}
            if prev is None and start != 0:
                raise DataError(f"data.stages entry {text!r}: the first stage must start at 0")
            if prev is not None and start <= prev.start:
                raise DataError(f"data.stages entry {text!r}: stages start in increasing order (sample {start} is "
                                f"not after the previous stage's {prev.start})")
            if prev is None and ramp:
                raise DataError(f"data.stages entry {text!r}: the first stage has no previous weights to ramp from")
            if prev is not None and length != prev.seq_len and (ramp or start % global_batch):
                raise DataError(f"data.stages entry {text!r} changes the sequence length ({prev.seq_len} -> {length}): "
                                f"it must start on a global batch boundary (a multiple of {global_batch} samples) and "
                                f"have no ramp, since one batch holds one length")
            stages.append(prev := Stage(start, ramp, length, tuple(weights.get(k, 0.0) for k in streams)))
        for a, b, text in zip(stages, stages[1:], texts[1:]):
            if a.ramp and a.start + a.ramp > b.start:
                raise DataError(f"data.stages entry {text!r} starts at sample {b.start}, inside the previous stage's "
                                f"ramp (to sample {a.start + a.ramp}); shorten that ramp")
        return cls(streams, tuple(stages))

    def seq_len_at(self, position: int) -> int:
        return self.stages[self.stage_at(position) - 1].seq_len

    def weights_at(self, positions: np.ndarray) -> np.ndarray:
        """(N, S) mixture weights of sample positions (rule step 1)."""
        starts = np.array([s.start for s in self.stages])
        k = np.searchsorted(starts, positions, side="right") - 1  # (N,) stage index
        w = np.array([s.weights for s in self.stages])  # (stages, S)
        ramp = np.array([s.ramp for s in self.stages])[k]
        f = np.where(ramp > 0, np.clip((positions - starts[k]) / np.maximum(ramp, 1), 0.0, 1.0), 1.0)[:, None]
        return (1.0 - f) * w[np.maximum(k - 1, 0)] + f * w[k]

    def stage_at(self, position: int) -> int:
        """1-based number of the stage that sample `position` belongs to."""
        return int(np.searchsorted([s.start for s in self.stages], position, side="right"))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (Steele, Lea, Flood 2014) on a uint64 array, in place, wrapping mod 2^64 (a 1M-position
    chunk makes one temporary, not seven)."""
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def uniform(positions: np.ndarray, seed: int) -> np.ndarray:
    """u(p) in [0, 1), 53 random bits (rule step 2)."""
    z = positions.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64((seed + 1) * GOLDEN % 2 ** 64)
    _mix(z)
    z >>= np.uint64(11)
    return z.astype(np.float64) * 2.0 ** -53


def draw_sources(plan: StagePlan, positions: np.ndarray, seed: int) -> np.ndarray:
    """stream(p) for each of the ascending positions (rule step 3), as indexes into plan.streams. Outside ramps a
    stage's weights are constant: one CDF for the whole stretch (the same numbers as weights_at's f = 1)."""
    u = uniform(positions, seed)
    out = np.empty(len(positions), np.int64)
    bounds = [s.start for s in plan.stages] + [np.iinfo(np.int64).max]
    for stage, end in zip(plan.stages, bounds[1:]):
        a, r, b = np.searchsorted(positions, [stage.start, stage.start + stage.ramp, end])
        if a < r:  # the ramp: weights per position
            cdf = np.cumsum(plan.weights_at(positions[a:r]), axis=1)
            out[a:r] = (cdf / cdf[:, -1:] <= u[a:r, None]).sum(axis=1)
        if r < b:
            cdf = np.cumsum(np.array(stage.weights))
            out[r:b] = np.searchsorted(cdf / cdf[-1], u[r:b], side="right")
    return out


class StageSampler:
    """Rule step 4: where each position reads. Keeps each source's count at global batch boundaries, computed
    forward on demand from the origin (batch 0 with zero counts, or a changed-stage resume's batch and counts)."""

    def __init__(self, plan: StagePlan, seed: int, global_batch: int, origin: tuple[int, np.ndarray] | None = None):
        self.plan, self.seed, self.G = plan, seed, global_batch
        self.origin_batch, counts = origin if origin is not None else (0, np.zeros(len(plan.streams), np.int64))
        # Counts before batch origin_batch + i, in chunks of rows: chunk c holds rows _starts[c] .. + len - 1.
        self._chunks, self._starts = [np.asarray(counts, np.int64).reshape(1, -1)], [0]
        self._known = 1
        self._lock = threading.Lock()  # the loader's read-ahead thread and the trainer both ask

    def counts_before(self, batch: int) -> np.ndarray:
        """Samples each stream gave to global batches [0, batch) (from the origin's counts on)."""
        i = batch - self.origin_batch
        if i < 0:
            raise DataError(f"batch {batch + 1} lies before batch {self.origin_batch + 1}, where the data stages were "
                            f"changed on resume: the current data.stages do not define it")
        with self._lock:
            while self._known <= i:
                b0, S = self.origin_batch + self._known - 1, len(self.plan.streams)
                n = max(1, min(i + 1 - self._known, CHUNK_SAMPLES // self.G))
                src = draw_sources(self.plan, np.arange(b0 * self.G, (b0 + n) * self.G), self.seed)
                per_batch = np.bincount(np.repeat(np.arange(n) * S, self.G) + src, minlength=n * S).reshape(n, S)
                self._chunks.append(self._chunks[-1][-1] + np.cumsum(per_batch, axis=0))
                self._starts.append(self._known)
                self._known += n
            c = bisect.bisect_right(self._starts, i) - 1
            return self._chunks[c][i - self._starts[c]]

    def locate(self, positions: range) -> tuple[np.ndarray, np.ndarray]:
        """(stream, index in that stream) of consecutive positions inside one global batch."""
        batch = positions.start // self.G
        src = draw_sources(self.plan, np.arange(batch * self.G, positions.stop), self.seed)
        before = self.counts_before(batch)
        index = np.empty(len(src), np.int64)
        for s in range(len(self.plan.streams)):
            mine = src == s
            index[mine] = before[s] + np.arange(mine.sum())
        k = positions.start - batch * self.G
        return src[k:], index[k:]


def stage_micro_batch(micro: int, seq_len: int, stage_seq_len: int, per_rank: int) -> int:
    """Sequences per microbatch in a stage of stage_seq_len tokens when train.micro_batch_size=micro holds
    seq_len-token ones: about the same tokens, rounded down to a divisor of the rank's per_rank samples, >= 1."""
    want = max(1, micro * seq_len // stage_seq_len)
    return max(d for d in range(1, min(want, per_rank) + 1) if per_rank % d == 0)


class StagedDataset:
    """The train samples of a staged run, by global position: dataset[p] is the sample of rule steps 1-4. Each
    stream is a list of megatron-core GPTDatasets, one per pass (hybridpar.data.gpt_data builds them); `names` are
    the sources' short names (metrics), in plan.sources order."""

    per_pass = None  # (each stream has its own passes)

    def __init__(self, sampler: StageSampler, streams: list[list], n_samples: int, names: list[str],
                 micro: int = 1, seq_len: int = 0, prefixes: list[str] | None = None):
        self.sampler, self.streams, self.n_samples, self.names = sampler, streams, n_samples, names
        self.micro, self.seq_len = micro, seq_len  # train.micro_batch_size and train.seq_len (micro_batch)
        self.prefixes = prefixes or [p for p, _ in sampler.plan.streams]  # each stream's source, as a file prefix

    def __len__(self) -> int:
        return self.n_samples

    def __getitem__(self, p: int) -> dict:
        (s,), (n,) = self.sampler.locate(range(p, p + 1))
        return self.read(int(s), int(n))

    def read(self, s: int, n: int) -> dict:
        passes = self.streams[s]
        per_pass = len(passes[0])
        if n // per_pass >= len(passes):
            prefix, length = self.sampler.plan.streams[s]
            raise DataError(f"data.stages: source {prefix} (seq {length}) was read to sample {n + 1}, past the "
                            f"{len(passes)} pass(es) built at start ({per_pass} samples each)")
        return passes[n // per_pass][n % per_pass]

    def rows(self, positions: range) -> list[dict]:
        """The samples of consecutive positions inside one global batch (what the loader reads)."""
        src, index = self.sampler.locate(positions)
        return [self.read(int(s), int(n)) for s, n in zip(src, index)]

    def locate(self, position: int) -> tuple[str, int | None, object, int]:
        """(source prefix, pass, its GPTDataset, sample in it) of a global position (gpt_data.Samples)."""
        (s,), (n,) = self.sampler.locate(range(position, position + 1))
        passes = self.streams[int(s)]
        per_pass = len(passes[0])
        return self.prefixes[int(s)], int(n) // per_pass, passes[int(n) // per_pass], int(n) % per_pass

    def holding(self, prefix: str, hits) -> list[tuple[int | None, int | None, object]]:
        """(position or None, 1-based pass, found) of every sample hits(GPTDataset) finds in the streams of `prefix`
        (hybridpar.data.gpt_data.Samples)."""
        found = []
        for stream, passes in enumerate(self.streams):
            if self.prefixes[stream] == prefix:
                per_pass = len(passes[0])
                for e, ds in enumerate(passes):
                    found += [(self._position_in_stream(stream, e * per_pass + i), e + 1, part)
                              for i, part in hits(ds)]
        return found

    def _position_in_stream(self, stream: int, n: int) -> int | None:
        """The global position of stream `stream`'s sample n (0-based): the batch by a binary search over the
        per-batch counts, then that batch's draws; None past the batches the data covers."""
        sampler, G = self.sampler, self.sampler.G
        lo, hi = sampler.origin_batch, len(self) // G  # counts_before(lo)[stream] <= n: find the last such batch
        if sampler.counts_before(hi)[stream] <= n:
            return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if sampler.counts_before(mid)[stream] <= n:
                lo = mid
            else:
                hi = mid
        src = draw_sources(sampler.plan, np.arange(lo * G, (lo + 1) * G), sampler.seed)
        k = n - int(sampler.counts_before(lo)[stream])
        return lo * G + int(np.flatnonzero(src == stream)[k])

    def micro_batch(self, batch: int, per_rank: int) -> int:
        """Sequences per microbatch in 0-based global batch `batch` (stage_micro_batch of its stage's length)."""
        plan = self.sampler.plan
        return stage_micro_batch(self.micro, self.seq_len, plan.seq_len_at(batch * self.sampler.G), per_rank)

    def restart_at(self, batch: int, counts: np.ndarray) -> None:
        """Apply the stages from global batch `batch` on, each stream continuing from `counts` (a changed-stage
        resume)."""
        self.sampler = StageSampler(self.sampler.plan, self.sampler.seed, self.sampler.G, (batch, counts))

    def origin(self) -> np.ndarray:
        """[origin batch, counts...]: what a checkpoint keeps to rebuild this sampler."""
        return np.concatenate([[self.sampler.origin_batch], self.sampler.counts_before(self.sampler.origin_batch)]
                              ).astype(np.int64)

    def trained_before(self, next_batch: int, windows: list[tuple[int, int]]) -> dict:
        """The metrics of what the batches before 0-based batch `next_batch` trained: `stage` and `seq_len` of the
        last sample, `samples/<source>` (each source's samples) and `consumed_tokens`. The batches in the skipped
        `windows` (1-based, inclusive) drew their samples but trained none; the batches before an origin count as
        its counts say."""
        sampler, plan = self.sampler, self.sampler.plan
        c = sampler.counts_before(next_batch).copy()
        for first, last in windows:
            a, b = max(first - 1, sampler.origin_batch), min(last, next_batch)
            if a < b:
                c -= sampler.counts_before(b) - sampler.counts_before(a)
        per_source = dict.fromkeys(plan.sources, 0)
        for (prefix, length), k in zip(plan.streams, c.tolist()):
            per_source[prefix] += k
        last = next_batch * sampler.G - 1
        return {"stage": plan.stage_at(last), "seq_len": plan.seq_len_at(last),
                "consumed_tokens": int(sum(k * length for (_, length), k in zip(plan.streams, c.tolist()))),
                **{f"samples/{n}": k for n, k in zip(self.names, per_source.values())}}


def stage_plan(cfg, tp: int) -> StagePlan | None:
    """data.stages parsed (their syntax, order and ramps checked) for the global batch size, each stage's sequence
    length checked against the model and sequence parallelism; None without stages."""
    if not cfg.data.stages:
        return None
    try:
        plan = StagePlan.parse(cfg.data.stages, cfg.train.global_batch_size, cfg.train.seq_len)
    except DataError as e:
        raise ConfigError(str(e)) from None
    for length in plan.seq_lens:
        if length > cfg.model.max_seq_len:
            raise ConfigError(f"data.stages: seq {length} exceeds model.max_seq_len={cfg.model.max_seq_len}; lower "
                              f"it or raise model.max_seq_len")
        if tp > 1 and cfg.parallel.sequence_parallel and length % tp:
            raise ConfigError(f"data.stages: seq {length} is not divisible by parallel.tp={tp} (sequence parallel "
                              f"shards the sequence); use a multiple of {tp}")
    return plan
