"""The suite's cost per test file for any commit, also one whose tests have no cost report of their own (before
HYBRIDPAR_COST_REPORT): wall seconds and Python interpreter starts, counted as tests/conftest.py counts them (a
sitecustomize on PYTHONPATH makes every interpreter started under the session write a line).

    PYTHONPATH=/path/to/hybridpar/tools SUITE_COST_OUT=files.json python -P -m pytest -q -p suite_cost

Writes {test file: [seconds, starts, tests]} to SUITE_COST_OUT. (With a tree whose conftest puts its own
sitecustomize first, that one counts and this plugin's starts stay 0: use the tree's HYBRIDPAR_COST_REPORT.)
"""

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

_DIR = Path(tempfile.mkdtemp(prefix="suite-cost-"))
(_DIR / "sitecustomize.py").write_text(
    "import os\ntry:\n    with open(os.environ['SUITE_COST_STARTS'], 'a') as f:\n        f.write(f'{os.getpid()}\\n')\n"
    "except Exception:\n    pass\n")
os.environ["PYTHONPATH"] = os.pathsep.join([str(_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
os.environ["SUITE_COST_STARTS"] = str(_DIR / "starts.log")
FILES: dict[str, list] = {}


def _starts() -> int:
    try:
        return Path(os.environ["SUITE_COST_STARTS"]).read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    t, n = time.perf_counter(), _starts()
    try:
        return (yield)
    finally:
        f = FILES.setdefault(item.nodeid.split("::")[0], [0.0, 0, 0])
        f[0] += time.perf_counter() - t
        f[1] += _starts() - n
        f[2] += 1


def pytest_unconfigure(config):
    out = os.environ.get("SUITE_COST_OUT")
    if out:
        Path(out).write_text(json.dumps(FILES, indent=1) + "\n")
