"""Print hybridpar's model zoo: `python launch/model_zoo.py [--json]`. Counts come from meta-device builds."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError
from hybridpar.models import count_params, get_model_config, list_models
from hybridpar.models.config import doc

COLUMNS = ("name", "n_params", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn", "context", "vocab")


def zoo_rows() -> list[dict]:
    rows = []
    for name in list_models():
        c = get_model_config(name)
        rows.append({"name": name, "n_params": count_params(c), "n_layers": c.n_layers, "d_model": c.d_model,
                     "n_heads": c.n_heads, "n_kv_heads": c.kv_heads, "ffn": c.ffn_dim, "context": c.max_seq_len,
                     "vocab": c.vocab_size, "norm": c.norm, "position": c.position, "mlp": c.mlp,
                     "tie_embeddings": c.tie_embeddings})
    return rows


def _human(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class Options:
    json: bool = doc(False, "print the rows as JSON instead of a table")


def main(argv: list[str]) -> int:
    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/model_zoo.py")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if parsed is None:
        return 0
    rows = zoo_rows()
    if parsed[0].json:
        print(json.dumps(rows, indent=1))
        return 0
    table = [COLUMNS] + [tuple(_human(r[c]) if c == "n_params" else str(r[c]) for c in COLUMNS) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS))]
    for row in table:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))))
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head` closed the pipe: stop quietly, as other Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush does not fail
        code = 0
    sys.exit(code)
