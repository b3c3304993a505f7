"""The built-in corpus: English text that ships with every CPython, so the default run needs no download.

Documents: every entry of `pydoc_data.topics` (the language reference behind `help()`, about 0.5 MB) and every
module, class and function docstring of the standard library's .py files (via `ast.get_docstring`, about 1.6 MB;
test suites, idlelib, lib2to3 and turtledemo are left out, as are docstrings under 40 characters). The text is
generated from the running interpreter, so it differs slightly between Python versions; its SHA-256 is logged
and keys every cache derived from it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
CORPUS_VERSION = 1  # bump when the extraction below changes


def _stdlib_docstrings(root: Path) -> list[str]:
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for fname in sorted(filenames):
            if not fname.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, fname).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node)
                    if text and len(text) >= 40:
                        docs.append(text)
    return docs


def build_documents() -> list[str]:
    """All documents of the built-in corpus, in a fixed shuffled order (so a split by position is a random split
    by document, not "the last modules of the alphabet")."""
    import pydoc_data.topics

    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    docs += _stdlib_docstrings(Path(sysconfig.get_paths()["stdlib"]))
    random.Random(0).shuffle(docs)
    return docs


def load_builtin_corpus(cache_dir: Path) -> tuple[list[str], str]:
    """The built-in documents and their SHA-256, built once per Python version and cached as JSON."""
    import platform

    path = cache_dir / f"corpus-builtin-v{CORPUS_VERSION}-py{platform.python_version()}.json"
    docs = None
    if path.is_file():
        try:
            docs = json.loads(path.read_text(encoding="utf-8"))  # JSON: nothing in it can run
        except (ValueError, UnicodeDecodeError) as e:
            why = str(e)
        else:
            why = "not a list of texts"
        if not (isinstance(docs, list) and all(isinstance(d, str) for d in docs)):
            print(f"warning: the built-in corpus cache {path} is damaged ({why[:80]}); built again", file=sys.stderr)
            docs = None
    if docs is None:
        docs = build_documents()
        atomic_write(path, json.dumps(docs))
    return docs, sha256_docs(docs)


def sha256_docs(docs: list[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def atomic_write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-written file is left behind
        tmp.unlink(missing_ok=True)
        raise
