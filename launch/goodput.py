"""Where a run's wall clock went, across every start of it (docs/goodput.md).

    python launch/goodput.py RUN [--out goodput.png]

RUN is a run directory: its goodput.json, which the trainer updates at every log row and checkpoint. Prints each
part's seconds and share of the wall clock, and goodput = productive / wall; --out also draws them (matplotlib).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError
from hybridpar.models.config import doc, doc_required

IMAGE_SUFFIXES = (".png", ".pdf", ".svg")


@dataclass(frozen=True)
class Options:
    run: str = doc_required("the run directory")
    out: str = doc("", "also draw the table into this image (.png, .pdf or .svg)")


def table(run_dir: Path) -> tuple[list[tuple[str, float]], float, float]:
    """((part, seconds) including other, wall seconds, goodput) of the run's record at its last update."""
    from hybridpar.training.goodput import FILE, Goodput, _read

    notes: list[str] = []
    saved = _read(run_dir, notes)
    if saved is None:
        raise ConfigError(notes[0].removeprefix("warning: ") if notes else
                          f"{run_dir} holds no {FILE}: give the run directory of a hybridpar run that has logged a "
                          f"step (--run.dir)")
    g = Goodput(saved["first_start"], {k: float(v) for k, v in saved["seconds"].items()})
    row = g.row(saved["last_seen"])
    parts = [(p, row[f"goodput/{p}_s"]) for p in g.seconds] + [("other", row["goodput/other_s"])]
    return parts, row["goodput/wall_s"], row["goodput"]


def draw(parts, wall: float, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(p, s) for p, s in parts if s > 0]
    fig, ax = plt.subplots(figsize=(10, 2.2))
    left = 0.0
    for part, seconds in shown:
        ax.barh([0], [seconds], left=left, label=f"{part} {seconds:.1f}s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall clock since the run's first start")
    ax.set_xlim(0, max(wall, left))
    ax.set_title(title)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def cli(argv: list[str]) -> int:
    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/goodput.py", positional="run")
        if parsed is None:
            return 0
        a, _ = parsed
        out = Path(a.out) if a.out else None
        if out is not None and (out.is_dir() or out.suffix.lower() not in IMAGE_SUFFIXES):
            raise ConfigError(f"--out {a.out}: name an image file ending in {', '.join(IMAGE_SUFFIXES)}")
        if out is not None and not out.parent.is_dir():
            raise ConfigError(f"--out {a.out}: directory {out.parent} does not exist; create it first or name a file "
                              f"in an existing directory")
        parts, wall, goodput = table(Path(a.run))
        print(f"{'part':18s} {'seconds':>10s} {'share':>7s}")
        for part, seconds in parts:
            print(f"{part:18s} {seconds:10.1f} {seconds / wall if wall else 0:7.1%}")
        print(f"{'wall':18s} {wall:10.1f}\ngoodput {goodput:.1%} (productive / wall)")
        if out is not None:
            draw(parts, wall, out, f"{a.run}: goodput {goodput:.1%}")
            print(f"wrote {out}")
    except ImportError:
        print('error: drawing needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
