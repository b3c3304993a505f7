"""Which documents each step of a run trained on, and where a document was trained (docs/provenance.md).

    python launch/provenance.py RUN --step S                 step S's samples: source, documents, token ranges
    python launch/provenance.py RUN --document SOURCE:INDEX  every step and sample that read that document
    python launch/provenance.py RUN --text "a snippet"       the same, for the document holding that text
    python launch/provenance.py RUN --steps A-B --out F.jsonl   the ledger of steps A to B, one sample a line

RUN is a run directory (--run.dir of the training command): what its latest checkpoint recorded (steps, skipped
batches, each start's data record) is read, never config.yaml; the data comes from data.cache_dir as each start
built it, its sources checked against their recorded fingerprints. No model and no GPU.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config.cli import parse_command
from hybridpar.errors import CheckpointError, ConfigError, DataError
from hybridpar.models.config import doc, doc_required


@dataclass(frozen=True)
class Options:
    run: str = doc_required("the run directory")
    step: int | None = doc(None, "list step STEP's samples (steps start at 1)")
    steps: str = doc("", "A-B: the ledger of steps A to B (with --out)")
    document: str = doc("", "SOURCE:INDEX: where document INDEX of source SOURCE (a name in data.path or "
                            "data.stages, 'builtin' for the built-in corpus) was trained")
    text: str = doc("", "where the document holding this text was trained (the text's tokens are looked up in "
                        "the run's sources)")
    out: str = doc("", "write the rows here as JSON lines instead of printing them (refuses an existing file)")


def _steps(text: str) -> range:
    a, sep, b = text.partition("-")
    try:
        first, last = int(a), int(b if sep else a)
    except ValueError:
        first = last = 0
    if first < 1 or last < first:
        raise ConfigError(f"--steps {text!r}: give A-B with 1 <= A <= B (e.g. --steps 1-100)")
    return range(first, last + 1)


def _document(text: str) -> tuple[str, int]:
    source, sep, index = text.rpartition(":")
    if not sep or not source or not index.isdigit():
        raise ConfigError(f"--document {text!r}: give SOURCE:INDEX, e.g. --document builtin:120")
    return source, int(index)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")  # (a non-UTF-8 argument arrives as lone surrogates)
    except UnicodeEncodeError:
        raise ConfigError(f"--text {_quoted(text)} is not valid UTF-8; give the snippet as UTF-8 text") from None
    if not text.strip():
        raise ConfigError("--text is blank; give a snippet of the document's text")


def _quoted(text: str, room: int = 60) -> str:
    """`text` as a message shows it: quoted, and cut to `room` characters with its length said."""
    shown = ascii(text) if any("\ud800" <= c <= "\udfff" for c in text) else repr(text)
    return shown if len(text) <= room else f"{shown[:room]}...' ({len(text):,} characters)"


def _show(rows: list[dict]) -> None:
    for r in rows:
        where = f"step {r['step']} sample {r['sample']} (position {r['position']})"
        if "documents" in r:
            docs = ", ".join(f"{d}[{a}:{b}]" for d, a, b in r["documents"])
            extra = (f" pass {r['pass']}" if "pass" in r else "") + (f" + {r['pad']} pad" if "pad" in r else "")
            print(f"{where}: {r['source']}{extra}: {docs}")
        else:
            print(f"{where}: {r['source']}:{r['document']}[{r['start']}:{r['stop']}]"
                  + (f" (pass {r['pass']})" if "pass" in r else ""))


def cli(argv: list[str]) -> int:
    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/provenance.py", positional="run")
        if parsed is None:
            return 0
        a, _ = parsed
        asked = [a.step is not None, bool(a.steps), bool(a.document), bool(a.text)]
        if sum(asked) != 1:
            raise ConfigError("give one of --step S, --steps A-B, --document SOURCE:INDEX or --text SNIPPET")
        if a.step is not None and a.step < 1:
            raise ConfigError(f"--step {a.step}: steps start at 1; give --step 1 for the run's first step")
        if a.text:
            _check_text(a.text)
        out = Path(a.out) if a.out else None
        if out is not None and out.exists():
            raise ConfigError(f"--out {a.out} exists; name a new file (nothing is overwritten)")
        if out is not None and not out.parent.is_dir():
            raise ConfigError(f"--out {a.out}: directory {out.parent} does not exist; create it first or name a file "
                              f"in an existing directory")
        if a.steps and out is None:
            raise ConfigError("--steps writes a ledger: give --out FILE.jsonl")
        steps = _steps(a.steps) if a.steps else None
        document = _document(a.document) if a.document else None
        from hybridpar.audit import open_ledger

        ledger = open_ledger(Path(a.run))
        try:
            return _answer(ledger, a, steps, document, out)
        finally:
            ledger.close()
    except (ConfigError, DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _answer(ledger, a, steps, document, out) -> int:
    """Print the rows asked for, or write them to `out` (a new file, whole or not at all)."""
    if a.text:
        found = ledger.find_text(a.text)
        if not found:
            raise DataError(f"--text {_quoted(a.text)}: no document of the run's sources holds it")
        print(f"--text is in {len(found)} document(s): {', '.join(f'{s}:{d}' for s, d in found)}")
        if out is None:
            for source, index in found:
                rows = ledger.document(source, index)
                _show(rows)
                print(f"{len(rows)} sample(s) of {len({r['step'] for r in rows})} step(s) read {source}:{index}")
            return 0
        rows = (row for source, index in found for row in ledger.document(source, index))
    elif steps is not None:
        if steps.stop - 1 > ledger.steps:
            raise ConfigError(f"--steps {a.steps}: the run trained steps 1 to {ledger.steps}")
        rows = (row for s in steps for row in ledger.step(s))
    elif document is not None:
        rows = ledger.document(*document)
    else:
        rows = ledger.step(a.step)  # (a list: checked before anything is written)
    if out is None:
        rows = list(rows)
        _show(rows)
        if document is not None:
            print(f"{len(rows)} sample(s) of {len({r['step'] for r in rows})} step(s) read {document[0]}:"
                  f"{document[1]}")
        return 0
    tmp, n = out.with_name(f".{out.name}.tmp"), 0
    try:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
                n += 1
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {n} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
