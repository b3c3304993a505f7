"""Downstream evaluation tasks: what a task file holds and how it is read (the schema is in docs/evaluation.md).

A task is a JSONL file, one example per line, every line of one kind:
- multiple choice (HellaSwag / ARC / PIQA style): {"context": str, "choices": [str, ...], "label": int}
- cloze (LAMBADA style): {"context": str, "target": str}: the target must be the greedy continuation
- perplexity: {"text": str}, one document a line; a .txt file is one document
The text of a choice or target is appended to the context as is (put the space before a word in the choice).
`builtin:next-words` is made from the built-in corpus's validation documents: the true last three words of a line
among the last three words of lines of other documents. (The true next line among lines of other documents of
its length was tried first: the default run's model scored 0.268 on it after 200 steps, within one standard error
of chance on its 213 examples; it scores 0.305 on this one, 318 examples, 2026-12-02.)
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.errors import ConfigError, DataError

KINDS = {"multiple_choice": ("context", "choices", "label"), "cloze": ("context", "target"), "perplexity": ("text",)}
BUILTIN = ("builtin:next-words",)


@dataclass(frozen=True)
class Task:
    name: str  # the file's stem, or the built-in task's name: metrics are eval/<name>/<metric>
    kind: str  # a key of KINDS
    examples: tuple  # of dicts with KINDS[kind]'s fields


MAX_CHOICES = 1000  # multiple-choice benchmarks have 2-10; a line of more is a mistake, and minutes of silent work


def _kind_of(row: dict, where: str) -> str:
    for kind, fields in KINDS.items():
        if set(row) >= set(fields):
            return kind
    raise ConfigError(f"{where}: a task line needs context + choices + label (multiple choice), context + target "
                      f"(cloze) or text (perplexity); it has {sorted(row)}")


def _check(row: dict, kind: str, where: str) -> None:
    bad = None
    if kind == "multiple_choice":
        ch, label = row["choices"], row["label"]
        if not isinstance(row["context"], str) or not isinstance(ch, list) or len(ch) < 2 or \
                not all(isinstance(c, str) and c for c in ch):
            bad = "context must be text and choices a list of two or more non-empty texts"
        elif len(ch) > MAX_CHOICES:  # each choice is a scored sequence: 10^5 of them are minutes of forwards a line
            bad = (f"{len(ch):,} choices, over {MAX_CHOICES:,}: each is a forward pass over its context; split the "
                   f"line or trim its choices")
        elif not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(ch):
            bad = f"label {label!r} must be an index into its {len(ch)} choices"
    elif kind == "cloze":
        if not isinstance(row["context"], str) or not isinstance(row["target"], str) or not row["target"]:
            bad = "context and target must be text, the target non-empty"
    elif not isinstance(row["text"], str) or not row["text"]:
        bad = "text must be non-empty text"
    if bad:
        raise ConfigError(f"{where}: {bad}")


def read_task(path: str | Path, name: str | None = None) -> Task:
    """A task file (JSONL, or .txt for one perplexity document). ConfigError with the file, line and fix."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"task file {str(p)!r} does not exist; give a .jsonl task file (docs/evaluation.md) or "
                          f"{', '.join(BUILTIN)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"task file {str(p)!r} cannot be read as UTF-8 text ({e})") from None
    name = name or p.stem
    if p.suffix == ".txt":
        if not raw.strip():
            raise ConfigError(f"task file {str(p)!r} is empty; a .txt task is one document to score")
        return Task(name, "perplexity", ({"text": raw},))
    rows, kind = [], None
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not a JSON object ({e.msg}); a task file holds one JSON object a line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: not a JSON object; a task file holds one JSON object a line")
        k = _kind_of(row, where)
        if kind is not None and k != kind:
            raise ConfigError(f"{where}: a {k.replace('_', ' ')} line in a {kind.replace('_', ' ')} task; one kind "
                              f"per file")
        kind = k
        _check(row, k, where)
        rows.append({f: row[f] for f in KINDS[k]})
    if not rows:
        raise ConfigError(f"task file {str(p)!r} holds no examples; one JSON object a line (docs/evaluation.md)")
    return Task(name, kind, tuple(rows))


def next_words_examples(docs: list[str], n_words: int = 3, per_doc: int = 2, n_max: int = 400,
                        seed: int = 0) -> list[dict]:
    """Multiple-choice examples from documents: a line of six or more words cut before its last n_words, with the
    lines before it (up to 300 characters) as the context; the true last words and the last words of three lines
    of other documents as the choices."""
    rng = random.Random(seed)
    lines = [[ln.strip() for ln in d.splitlines() if len(ln.split()) >= 6] for d in docs]
    tails = [(i, " " + " ".join(ln.split()[-n_words:])) for i, ls in enumerate(lines) for ln in ls]
    out = []
    for i, ls in enumerate(lines):
        for k in sorted(rng.sample(range(len(ls)), min(per_doc, len(ls)))):
            if len(out) == n_max:
                return out
            words = ls[k].split()
            true = " " + " ".join(words[-n_words:])
            context = "\n".join(ls[:k] + [" ".join(words[:-n_words])])[-300:]
            others = []
            for _ in range(100):  # (a corpus of a few documents may not have three other tails)
                j, tail = tails[rng.randrange(len(tails))]
                if j != i and tail != true and tail not in others:
                    others.append(tail)
                if len(others) == 3:
                    break
            else:
                continue
            label = rng.randrange(4)
            out.append({"context": context, "choices": others[:label] + [true] + others[label:], "label": label})
    return out


def builtin_task(spec: str, data) -> Task:
    """A built-in task, made from the validation split of the built-in corpus (data: the run's DataConfig) and
    cached beside it as JSONL (so lm-eval or another tool can read the same examples)."""
    from hybridpar.data.corpus import atomic_write, load_builtin_corpus
    from hybridpar.data.gpt_data import split_ranges

    if spec not in BUILTIN:
        raise ConfigError(f"{spec!r} is not a built-in task; use one of {', '.join(BUILTIN)} or a task file")
    docs, sha = load_builtin_corpus(data.cache_path)
    (_, _), (vb, ve), _ = split_ranges(len(docs), data.split_fractions)
    path = data.cache_path / f"task-next-words-v1-{sha[:16]}-{vb}-{ve}.jsonl"
    if path.is_file():
        try:
            return read_task(path, name="next-words")
        except (ConfigError, DataError) as e:
            print(f"warning: the built-in task cache {path} is damaged ({str(e)[-80:]}); built again", file=sys.stderr)
    rows = next_words_examples(docs[vb:ve])
    atomic_write(path, "".join(json.dumps(r) + "\n" for r in rows))
    return read_task(path, name="next-words")


def load_tasks(specs: list[str], data) -> list[Task]:
    """Every task of `specs` (file paths or builtin:NAME), read and checked now: a bad one is a ConfigError before
    any work."""
    tasks = [builtin_task(s, data) if s.startswith("builtin:") else read_task(s) for s in specs]
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"two evaluation tasks are named {dup[0]!r} (a task's name is its file's stem); rename one")
    return tasks
