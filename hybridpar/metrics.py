"""Where metrics go: <run.dir>/metrics.jsonl (the source of truth), the console, and W&B when enabled.

Only the logging rank (global rank 0) writes; the other ranks get a logger that drops everything.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from hybridpar.config import Config


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class MetricsLogger:
    """Appends one JSON object per call to metrics.jsonl, prints a console line, forwards to W&B."""

    def __init__(self, cfg: Config, run_dir: Path, enabled: bool, config_dict: dict | None = None, out=sys.stdout):
        self.enabled, self.out, self.total_steps = enabled, out, cfg.train.steps
        self.file = None
        self.wandb_run = None
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        w = cfg.logging.wandb
        if w.mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(mode=w.mode, project=w.project, entity=w.entity,
                                        name=w.name or cfg.run.name, group=w.group, tags=w.tags or None,
                                        dir=w.dir or str(run_dir), config=config_dict)

    def print(self, message: str) -> None:
        if self.enabled:
            print(message, file=self.out, flush=True)

    def log(self, row: dict) -> None:
        """Record one row: {"step": int, ...}. Training rows (with "loss") also print a console line."""
        if not self.enabled:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        if "loss" in row:
            eta = row.get("step_time", float("nan")) * (self.total_steps - row["step"])
            self.print(f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps} | "
                       f"loss {row['loss']:.4f} | lr {row['lr']:.2e} | grad_norm {row['grad_norm']:.3f} | "
                       f"{row['tokens_per_sec']:,.0f} tok/s | ETA {_fmt_eta(eta)}")
        elif "val_loss" in row:
            self.print(f"step {row['step']:>{len(str(self.total_steps))}}/{self.total_steps} | "
                       f"val_loss {row['val_loss']:.4f} | val_ppl {row['val_ppl']:.1f}")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
