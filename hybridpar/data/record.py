"""What data a run trained on, recorded by the run itself: one segment per start that changed it.

A segment is a plain JSON object: the step after which it governs (0 for a fresh run, the checkpoint's step for a
resume), the resolved config of that start (the data settings, and the settings that decide megatron-core's sample
order: seed, seq_len, global batch, the batches the split is built for), each source's fingerprint (its .idx's
SHA-256, its .bin's size, its document count) and whether checkpoint.allow_data_change allowed the change. The list
lives in the training loop's state (TrainState.data_segments), so every checkpoint carries the record of every
start before it, append-only: a user edits no file of it. A resume compares the files on disk with the last
segment (a source re-preprocessed under the same prefix is refused, or with allow_data_change, recorded); provenance
(hybridpar.audit) ledgers each step with the segment then in force and checks every file it reads against it.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from hybridpar.errors import CheckpointError

# What the consumed-samples position means: change any of these and the same position indexes other samples.
DATA_FIELDS = (("train", "seed"), ("train", "seq_len"), ("data", "path"), ("data", "split"), ("data", "tokenizer"),
               ("data", "stages"))
STAGE_FIELDS = DATA_FIELDS[-1:]  # in the data key only when data.stages is set: older checkpoints keep their key
# (data.source_exhausted is not among them: wrap and stop draw the same samples; stop only refuses a run that
# would read a source past its first pass)

_DIGESTS: dict[tuple, str] = {}  # (path, size, mtime_ns) -> the file's SHA-256, hashed once per process


def _sha256(path: str) -> str:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def fingerprint(prefix: str) -> dict:
    """A source's identity: its .idx's SHA-256 (document lengths and offsets), its .bin's size and its document
    count (the .idx holds it; read through IndexedTokens, which checks the file first)."""
    from hybridpar.data.indexed import IndexedTokens, bin_path, idx_path

    return {"idx_sha256": _sha256(str(idx_path(prefix))), "bin_bytes": os.path.getsize(bin_path(prefix)),
            "documents": len(IndexedTokens(prefix))}


def segment(cfg, from_step: int, prefixes: list[str], allowed: bool = False) -> dict:
    """The segment of a start at step `from_step` with resolved config `cfg` reading `prefixes` (on disk)."""
    from hybridpar.config.cli import to_dict
    from hybridpar.data.dataset import train_batches

    return {"from_step": int(from_step), "config": to_dict(cfg), "train_batches": train_batches(cfg),
            "sources": {p: fingerprint(p) for p in prefixes}, "allowed_change": bool(allowed)}


def _what_defines(seg: dict) -> tuple:
    """The parts of a segment that decide which samples a position holds."""
    c = seg["config"]
    fields = tuple(json.dumps(c.get(a, {}).get(b)) for a, b in DATA_FIELDS)
    return fields, c.get("train", {}).get("global_batch_size"), seg["train_batches"], json.dumps(seg["sources"],
                                                                                                  sort_keys=True)


def source_changes(last: dict, now: dict) -> list[str]:
    """The sources of `now` whose files differ from those `last` recorded, one 'PREFIX: what' each."""
    out = []
    for prefix, fp in now["sources"].items():
        was = last["sources"].get(prefix)
        if was is None or was == fp:
            continue
        what = [f"{k} {was.get(k)} -> {v}" if k != "idx_sha256" else f".idx sha256 {str(was.get(k))[:12]} -> {v[:12]}"
                for k, v in fp.items() if was.get(k) != v]
        out.append(f"{prefix}: {', '.join(what)}")
    return out


def extend(segments: list[dict], now: dict, allow_change: bool, checkpoint) -> list[dict]:
    """The record after a resume from `checkpoint` whose start is `now`: unchanged when it reads what the last
    segment read, else with `now` appended. A source whose files changed under the same prefix is refused (a
    CheckpointError naming it) unless allow_change, and recorded as allowed."""
    if not segments:  # (a checkpoint written before runs recorded their data: known from this start on)
        return [now]
    last = segments[-1]
    changed = source_changes(last, now)
    if changed and not allow_change:
        raise CheckpointError(f"resuming from {checkpoint}: a data source changed on disk since the run read it "
                              f"({'; '.join(changed)}): the saved position would index other documents; restore "
                              f"the files, or pass --checkpoint.allow_data_change true to continue on the new ones")
    if _what_defines(last) == _what_defines(now):
        return segments
    return [*segments, {**now, "allowed_change": bool(changed or allow_change)}]


def to_tensor(segments: list[dict]) -> torch.Tensor:
    return torch.tensor(list(json.dumps(segments, sort_keys=True).encode()), dtype=torch.uint8)


def of_tensor(t, where) -> list[dict]:
    """The segments of a checkpoint's uint8 JSON; a damaged one is a one-line CheckpointError."""
    try:
        out = json.loads(bytes(t.tolist() if hasattr(t, "tolist") else t).decode())
        if not isinstance(out, list) or not all(isinstance(s, dict) and isinstance(s.get("from_step"), int)
                                                and isinstance(s.get("config"), dict)
                                                and isinstance(s.get("sources"), dict) for s in out):
            raise ValueError("not a list of segments")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: its record of the run's data is damaged ({e}); use another checkpoint") \
            from None
    return out
