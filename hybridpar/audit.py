"""A finished (or running) run's provenance ledger, opened from its run directory: what the run recorded in its
latest checkpoint (its position, the batches it skipped, and the data record of every start: hybridpar.data.record),
checked against the sources on disk, and the data built as each start built it (hybridpar.data.provenance holds
the ledger's arithmetic). No file a user edits is read: not config.yaml, not skipped_batches.json."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch.distributed as dist

from hybridpar.data.provenance import Ledger
from hybridpar.errors import ConfigError, DataError


@dataclass
class Part:
    """The steps (first, last], 1-based inclusive of last, that one recorded segment governs: its ledger, or why
    its steps cannot be known."""
    first: int  # the segment governs steps first + 1 ... last
    last: int
    ledger: Ledger | None
    unknown: str = ""


class RunLedger:
    """The ledger of a whole run: each step answered by the segment in force when it was trained."""

    def __init__(self, parts: list[Part], steps: int, own_group: bool):
        self.parts, self.steps, self.own_group = parts, steps, own_group
        known = [p.ledger for p in parts if p.ledger is not None]
        self.tokenizer = known[-1].tokenizer if known else None

    def __enter__(self) -> "RunLedger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def windows(self) -> list[tuple[int, int]]:
        """The skipped batches (1-based, inclusive), as the run's latest checkpoint holds them."""
        return next((p.ledger.windows for p in self.parts if p.ledger is not None), [])

    def close(self) -> None:
        from hybridpar.data.gpt_data import release_index_readers

        release_index_readers()
        if self.own_group and dist.is_initialized():
            dist.destroy_process_group()

    def _part(self, step: int) -> Part:
        return next(p for p in self.parts if p.first < step <= p.last)

    def step(self, step: int) -> list[dict]:
        if not 1 <= step <= self.steps:
            raise DataError(f"--step {step}: the run trained steps 1 to {self.steps}")
        part = self._part(step)
        if part.ledger is None:
            raise DataError(f"--step {step}: steps {part.first + 1} to {part.last} {part.unknown}")
        return part.ledger.step(step)

    def document(self, source: str, document: int) -> list[dict]:
        known = [p for p in self.parts if p.ledger is not None]
        unknown = [p for p in self.parts if p.ledger is None and p.last > p.first]
        if unknown:
            p = unknown[0]
            raise DataError(f"--document {source}:{document}: steps {p.first + 1} to {p.last} {p.unknown}, so where "
                            f"the document was trained cannot be known")
        rows, reads = [], []
        for p in known:
            if not p.ledger.reads(source):
                continue
            reads.append(p)
            rows += [r for r in p.ledger.document(source, document) if p.first < r["step"] <= p.last]
        if not reads:
            return known[0].ledger.document(source, document)  # (its error names the run's sources)
        return sorted(rows, key=lambda r: (r["step"], r["sample"]))

    def find_text(self, text: str) -> list[tuple[str, int]]:
        found: dict = {}
        for p in self.parts:
            if p.ledger is not None:
                found.update(dict.fromkeys(p.ledger.find_text(text)))
        return sorted(found)


def open_ledger(run_dir: Path) -> RunLedger:
    """The ledger of the run in `run_dir`: its latest checkpoint's position, skipped windows and data record; each
    segment's sources checked against the files on disk, and its data built as that start built it (megatron-core's
    index caches in data.cache_dir; one process, no model, no GPU)."""
    from hybridpar.checkpoint.dcp import read_trainer_state
    from hybridpar.checkpoint.layout import MARKER, STEP_DIR, latest_checkpoint
    from hybridpar.data.record import fingerprint, of_tensor, source_changes

    run_dir = Path(run_dir)
    if STEP_DIR.fullmatch(run_dir.name) and (run_dir / MARKER).exists():
        raise ConfigError(f"{run_dir} is a checkpoint: give the run directory that holds it "
                          f"({run_dir.parent.parent})")
    if not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"{run_dir} holds no checkpoints/: give the run directory of a hybridpar run (--run.dir)")
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigError(f"{run_dir} holds no complete checkpoint: its steps are known from checkpoints only")
    state = read_trainer_state(latest)
    if "data_record" not in state:
        raise DataError(f"{latest} holds no record of the run's data (written before hybridpar recorded it): which "
                        f"documents its steps read cannot be known")
    segments, steps = of_tensor(state["data_record"], latest), int(state["step"])
    windows = [tuple(w) for w in state["skip_windows"]]
    own_group = not dist.is_initialized()
    if own_group:  # (megatron-core's blends ask for the rank)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parts = [] if not segments or segments[0]["from_step"] == 0 else [
        Part(0, segments[0]["from_step"], None, "were trained before the run recorded its data (a checkpoint of "
                                                 "an older hybridpar was resumed)")]
    try:
        for k, seg in enumerate(segments):
            last = segments[k + 1]["from_step"] if k + 1 < len(segments) else steps
            first = seg["from_step"]
            if last <= first or first >= steps:
                continue
            last = min(last, steps)
            now = {}
            for prefix in seg["sources"]:
                try:
                    now[prefix] = fingerprint(prefix)
                except (OSError, DataError) as e:
                    now[prefix] = {"missing": str(e).splitlines()[0][:200]}
            changed = source_changes(seg, {"sources": now})
            if changed:
                parts.append(Part(first, last, None, f"read sources that changed on disk since ({'; '.join(changed)})"
                                                     f": restore them to ledger these steps"))
                continue
            parts.append(Part(first, last, _segment_ledger(seg, windows, steps)))
    except BaseException:
        if own_group:
            dist.destroy_process_group()
        raise
    if not parts:
        raise DataError(f"{latest}: its record of the run's data names no steps; use another checkpoint")
    return RunLedger(parts, steps, own_group)


def _segment_ledger(seg: dict, windows, steps: int) -> Ledger:
    """The ledger of one recorded start's data (its resolved config), as that start built it."""
    from hybridpar.config.cli import config_from_dict
    from hybridpar.data.dataset import build_training_data, load_data_tokenizer, prepare_builtin, source_names
    from hybridpar.data.stages import StagePlan

    cfg = config_from_dict(seg["config"])
    cfg = replace(cfg, train=replace(cfg.train, device="cpu", eval_interval=0))
    d, t = cfg.data, cfg.train
    plan = StagePlan.parse(d.stages, t.global_batch_size, t.seq_len) if d.stages else None
    tokenizer = load_data_tokenizer(d, plan)
    data = build_training_data(cfg, tokenizer, plan, 0, 1)
    data.train.close()  # (only the dataset is read: no loader thread)
    if seg.get("stage_origin"):  # a start that changed the stages: the sampler continued each source's count
        import numpy as np

        origin = seg["stage_origin"]
        data.train.dataset.restart_at(int(origin[0]), np.asarray(origin[1:], dtype=np.int64))
    builtin = prepare_builtin(d, tokenizer)[0] if d.path == "builtin" or (plan and "builtin" in plan.sources) else None
    names = plan.sources if plan is not None else _blend_names(d.path)
    sources = {n: str(builtin) if n == "builtin" else n for n in names}
    aliases = {short: sources[n] for short, n in zip(source_names(names), names) if short not in sources}
    return Ledger(data.train.dataset, t.global_batch_size, windows, steps, sources, tokenizer, aliases)


def _blend_names(path: str) -> list[str]:
    from hybridpar.data.stages import parse_blend

    return ["builtin"] if path == "builtin" else [p for _, p in parse_blend(path)]
