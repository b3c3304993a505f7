"""Plot the metrics of one or more runs (their metrics.jsonl), overlaid: loss, validation loss, learning rate,
tokens/s and MFU, against step and against tokens; a spike rewind (train.spike=rewind) is a dashed line, the steps
it abandoned faint dots.

    python launch/plot_metrics.py runs/a runs/b --out plots.png

Needs matplotlib (pip install -e ".[plot]").
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError
from hybridpar.models.config import doc, doc_required

PANELS = [("loss", "train loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens/s (global)"), ("mfu", "MFU")]
NOT_PLOTTED = ("examples", "seconds", "chance")  # of a task's metrics (eval/<task>/<metric>)


def task_panels(runs: dict[str, list[dict]]) -> list[tuple[str, str]]:
    """A panel per downstream-task metric the runs logged (eval/<task>/<metric>, e.g. eval/next-words/acc_norm)."""
    keys = sorted({k for rows in runs.values() for r in rows for k in r
                   if k.startswith("eval/") and k.rsplit("/", 1)[-1] not in NOT_PLOTTED})
    return [(k, k.removeprefix("eval/").replace("/", " ")) for k in keys]


IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


class MetricsError(ValueError):
    """A run directory whose metrics cannot be plotted; the message names it."""


def read_rows(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl. A line that is not a JSON object (torn by a killed run, or damaged) is
    skipped with a warning naming it; a file with no rows at all is an error."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise MetricsError(f"{run_dir}: no metrics.jsonl; give run directories")
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        numbers = ([v for k, v in row.items() if k.startswith("eval/")] + [row.get(k) for k, _ in PANELS +
                   [("consumed_tokens", "")]]) if isinstance(row, dict) else []
        if not isinstance(row, dict) or type(row.get("step")) is not int or not all(
                v is None or type(v) in (int, float) for v in numbers):
            print(f"warning: {path}:{n} is not a metrics row (torn or damaged line: a step or value that is not a "
                  f"number); skipped", file=sys.stderr)
            continue
        rows.append(row)
    if not rows:
        raise MetricsError(f"{path} holds no metrics rows yet (the run logs one every logging.interval steps); "
                           f"nothing to plot")
    return rows


def plot(run_dirs: list[Path], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): read_rows(d) for d in run_dirs}  # every run read before anything is written
    panels = PANELS + task_panels(runs)
    fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3 * len(panels)), squeeze=False)
    for row, (key, title) in enumerate(panels):
        for col, xkey in enumerate(("step", "consumed_tokens")):
            ax = axes[row][col]
            for name, rows in runs.items():
                tokens_per_step = next((r["consumed_tokens"] / r["step"] for r in rows
                                        if r.get("consumed_tokens") and r.get("step")), None)
                scale = 1 if xkey == "step" else tokens_per_step or 0
                # A rewind trains steps again: the run's curve is each step's last row; the rows it replaced
                # (the pass abandoned) are faint dots, and each rewind a dashed line at the step that spiked.
                last: dict[int, float] = {}
                abandoned = []
                for r in rows:
                    if key in r and r[key] is not None:
                        if r["step"] in last:
                            abandoned.append((r["step"] * scale, last[r["step"]]))
                        last[r["step"]] = r[key]
                pts = sorted((s * scale, v) for s, v in last.items())
                if pts:
                    line, = ax.plot(*zip(*pts), label=Path(name).name,
                                    marker="." if key == "val_loss" or key.startswith("eval/") else None)
                    if abandoned:
                        ax.plot(*zip(*abandoned), ".", color=line.get_color(), alpha=0.35, markersize=4)
                    for r in rows:
                        if key == "loss" and "rewind" in r:
                            ax.axvline(r["step"] * scale, color=line.get_color(), linestyle="--", alpha=0.5)
                            ax.annotate(f"rewind to {r['rewind_to']}", (r["step"] * scale, max(last.values())),
                                        fontsize=7, rotation=90, va="top", ha="right", color=line.get_color())
            if not ax.lines:
                ax.text(0.5, 0.5, "not recorded (e.g. MFU on a device without a known peak)", ha="center",
                        va="center", transform=ax.transAxes, color="gray")
            ax.set_title(f"{title} vs {'step' if xkey == 'step' else 'tokens'}")
            ax.grid(alpha=0.3)
            if key == "loss" and col == 0:
                ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


@dataclass(frozen=True)
class Options:
    runs: list[str] = doc_required("run directories (each with metrics.jsonl)")
    out: str = doc("metrics.png", "the image to write")


def cli(argv: list[str]) -> int:
    try:
        parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/plot_metrics.py", positional="runs")
        if parsed is None:
            return 0
        a, _ = parsed
        out = Path(a.out)
        if out.is_dir() or out.suffix.lower() not in IMAGE_SUFFIXES:
            raise MetricsError(f"--out {a.out}: name an image file ending in {', '.join(IMAGE_SUFFIXES)} (it was "
                               f"{'a directory' if out.is_dir() else 'no image type matplotlib writes'})")
        plot([Path(r) for r in a.runs], out)
    except ImportError:
        print('error: plotting needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    except (MetricsError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
