"""Pretrain a GPT with hybridpar.

    python launch/pretrain_gpt.py                                  # tiny model on the built-in corpus
    python launch/pretrain_gpt.py --config configs/gpt2-124m.yaml --train.steps 1000
    python launch/pretrain_gpt.py --help                           # every field, its docstring and default
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch.distributed as dist

from hybridpar.checkpoint import CheckpointHook
from hybridpar.config import Config
from hybridpar.config_cli import ConfigError, dump_yaml, help_text, load_config, to_dict
from hybridpar.distributed import init_mesh, pick_device, shutdown, world_from_env
from hybridpar.metrics import MetricsLogger
from hybridpar.trainer import Trainer, TrainResult


def prepare_run_dir(cfg: Config) -> Path:
    """Fill run.name and run.dir (the same on every rank) and refuse to clobber an earlier run."""
    if cfg.run.name is None:
        name = [f"{cfg.model.name}-{time.strftime('%Y%m%d-%H%M%S')}"]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(name, src=0)
        cfg.run.name = name[0]
    if cfg.run.dir is None:
        cfg.run.dir = str(Path("runs") / cfg.run.name)
    run_dir = Path(cfg.run.dir)
    if (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite:
        raise ConfigError(f"run.dir={cfg.run.dir!r} already holds a run (metrics.jsonl); pass a new --run.dir, "
                          f"or --run.overwrite true to replace it")
    return run_dir


def main(cfg: Config) -> TrainResult:
    """Train with `cfg` on the processes the launcher started (one without a launcher)."""
    world = world_from_env()
    device = pick_device(cfg.train.device, world.local_rank)
    mesh = init_mesh(cfg.parallel, device, world)
    try:
        run_dir = prepare_run_dir(cfg)
        if cfg.checkpoint.load:
            print("warning: checkpoint.load is not applied: this build of hybridpar saves checkpoints but does not "
                  "resume from them yet", file=sys.stderr)
        hooks = [CheckpointHook(cfg.checkpoint.interval, cfg.checkpoint.keep_last)]
        trainer = Trainer(cfg, mesh, device, run_dir, hooks=hooks)
        if world.rank == 0:  # only now, with every input checked, does the run write anything
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
            (run_dir / "config.yaml").write_text(dump_yaml(cfg))
            trainer.tokenizer.save(run_dir)
            trainer.log = MetricsLogger(cfg, run_dir, enabled=True, config_dict=to_dict(cfg))
            trainer.log.print(f"run dir {run_dir}")
        return trainer.fit()
    finally:
        shutdown()


def cli(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
        main(cfg)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
