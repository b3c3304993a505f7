"""Convert hybridpar checkpoints to and from the formats the ecosystem reads.

    python launch/convert_checkpoint.py to-hf --checkpoint runs/x/checkpoints/step_00001000 --out hf/x
    python launch/convert_checkpoint.py from-hf --hf hf/gpt2 --out ckpt/gpt2
    python launch/convert_checkpoint.py to-torch --checkpoint runs/x/checkpoints/step_00001000 --out export/x
    python launch/convert_checkpoint.py from-megatron --megatron /path/to/megatron/save --out ckpt/m
    python launch/convert_checkpoint.py to-megatron --checkpoint runs/x --out megatron/x

to-hf: a transformers folder (config.json, model.safetensors, and the run's tokenizer.json if it has one) for
GPT2LMHeadModel (GPT-2/GPT-3 family) or LlamaForCausalLM (modern family); load it with
AutoModelForCausalLM.from_pretrained. from-hf: a weights checkpoint to start training from:
    python launch/pretrain_gpt.py --config ckpt/gpt2/config.yaml --checkpoint.load ckpt/gpt2 \\
        --checkpoint.load_weights_only true ...
from-megatron: a Megatron-LM save directory (torch_dist or legacy torch format; its latest iteration, or
--iteration N, or one iter_XXXXXXX directory) -> a weights checkpoint as from-hf writes, its config.yaml holding the
model shape and training settings from Megatron-LM's saved args. to-megatron: a torch_dist save directory that
Megatron-LM loads (e.g. with --finetune, or --no-load-optim --no-load-rng). See docs/checkpoints.md.
to-torch: model.safetensors + config.yaml, written one tensor at a time; hybridpar.models.load_pretrained(DIR)
returns a ready model. transformers is needed for to-hf/from-hf only (pip install -e ".[hf]").
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Literal, Optional

from hybridpar.checkpoint.dcp import CheckpointError, check_config_matches_tensors, load_full_model_state
from hybridpar.checkpoint.layout import MARKER, resolve_load_path
from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError, UserError, write_refused
from hybridpar.models.config import doc, doc_required
from hybridpar.checkpoint.resume_checks import read_checkpoint_config
from hybridpar.checkpoint.safe_load import read_metadata


def _config(ckpt: Path):
    from hybridpar.config.cli import config_from_dict

    saved = read_checkpoint_config(ckpt)
    if saved is None:
        raise CheckpointError(f"{ckpt} has no config.yaml; it was not written by hybridpar's trainer")
    cfg = config_from_dict(saved)
    check_config_matches_tensors(ckpt, cfg.model)
    return cfg


def _write_weights_checkpoint(out: Path, sd: dict, cfg, source: str) -> None:
    """A weights checkpoint a run can start from (`--checkpoint.load OUT --checkpoint.load_weights_only true`):
    the model's tensors as DCP, the config.yaml, and the COMPLETE marker last."""
    import torch.distributed.checkpoint as dcp

    from hybridpar.config.cli import dump_yaml

    dcp.save({"model": sd}, checkpoint_id=str(out), no_dist=True)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    (out / MARKER).write_text(f"{source}\n")


def _publish(partial: Path, out: Path) -> None:
    """Put the finished `partial` directory at `out`, replacing what --overwrite allowed to be there."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    partial.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--out {out} is not empty; pass --overwrite or another directory")


def _our_metas(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = read_metadata(ckpt).state_dict_metadata
    return {k[len("model."):]: (m.properties.dtype, tuple(m.size)) for k, m in meta.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def to_hf_cmd(a) -> str:
    from hybridpar.checkpoint.layout import optional_file_of
    from hybridpar.interop.hf import (TOKENIZER_FILES, export_hf_tokenizer, family, hf_export_plan,
                                      write_safetensors_streaming)

    ckpt = resolve_load_path(a.checkpoint)
    cfg = _config(ckpt).model
    family(cfg)  # fails before any heavy work for an architecture HF has no class for
    for name in TOKENIZER_FILES:  # each a regular file of the checkpoint, never a link out of it: checked first
        optional_file_of(ckpt, name)
    hf_cfg, metas, sources = hf_export_plan(cfg, _our_metas(ckpt))

    def load_one(name):  # one of their tensors, from the one to three of ours it is made of
        ours, make = sources[name]
        sd = load_full_model_state(ckpt, names=ours)
        return make([sd[o] for o in ours])

    a.out.mkdir(parents=True, exist_ok=True)
    eod, tokenizer_note = export_hf_tokenizer(ckpt, a.out, cfg.max_seq_len)
    eod = 0 if eod is None else eod  # the byte tokenizer's end of document
    # The run's own special ids, not GPT-2's 50256, so that generate() stops at an end of document.
    hf_cfg.bos_token_id = hf_cfg.eos_token_id = hf_cfg.pad_token_id = eod
    hf_cfg.save_pretrained(a.out)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod).save_pretrained(a.out)
    write_safetensors_streaming(a.out / "model.safetensors", metas, load_one)
    return (f"wrote {a.out} ({hf_cfg.architectures[0]}, {len(metas)} tensors, one at a time; {tokenizer_note}) "
            f"from {ckpt}")


def from_hf_cmd(a) -> str:
    from hybridpar.config import Config, TrainConfig
    from hybridpar.checkpoint.layout import regular_file_of
    from hybridpar.interop.hf import from_hf

    if not (a.hf / "config.json").is_file():
        raise CheckpointError(f"--hf {a.hf} has no config.json; give a transformers model folder")
    tok = regular_file_of(a.hf, "tokenizer.json") if (a.hf / "tokenizer.json").exists() else None
    model_cfg, sd = from_hf(a.hf)
    cfg = Config(model=model_cfg, train=TrainConfig(seq_len=min(TrainConfig.seq_len, model_cfg.max_seq_len)))
    if tok is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tok, a.out / "tokenizer.json")
    _write_weights_checkpoint(a.out, sd, cfg, "from-hf")
    return f"wrote {a.out} ({model_cfg.n_layers} layers, d_model {model_cfg.d_model}, vocab {model_cfg.vocab_size})"


def from_megatron_cmd(a) -> str:
    from hybridpar.config.cli import config_from_dict
    from hybridpar.interop.megatron import read_megatron, resolve_iteration_dir, run_settings

    iter_dir = resolve_iteration_dir(a.megatron, a.iteration)
    model_cfg, sd, args, fmt = read_megatron(iter_dir)
    settings = run_settings(args)  # Megatron-LM's batch, schedule and optimizer settings, where hybridpar has them
    train = settings.setdefault("train", {})
    train["seq_len"] = min(train.get("seq_len", model_cfg.max_seq_len), model_cfg.max_seq_len)
    cfg = config_from_dict({**settings, "model": vars(model_cfg)})
    _write_weights_checkpoint(a.out, sd, cfg, "from-megatron")
    return (f"wrote {a.out} ({model_cfg.n_layers} layers, d_model {model_cfg.d_model}, vocab {model_cfg.vocab_size}) "
            f"from {iter_dir} ({fmt})")


def to_megatron_cmd(a) -> str:
    import json
    import torch
    import torch.distributed.checkpoint as dcp

    from hybridpar.interop.megatron import megatron_args, to_megatron_state

    ckpt = resolve_load_path(a.checkpoint)
    cfg = _config(ckpt)
    iteration = a.iteration if a.iteration is not None else _step_or_zero(ckpt)
    state = to_megatron_state(cfg.model, load_full_model_state(ckpt))
    iter_dir = a.out / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(iter_dir), no_dist=True)
    torch.save({"args": megatron_args(cfg.model, cfg.train, iteration), "checkpoint_version": 3.0,
                "iteration": iteration}, iter_dir / "common.pt")
    (iter_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                         "common_backend": "torch", "common_backend_version": 1}))
    (a.out / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return f"wrote {iter_dir} (torch_dist, {len(state)} tensors) from {ckpt}"


def _step_or_zero(ckpt: Path) -> int:
    from hybridpar.checkpoint.layout import step_of

    try:
        return step_of(ckpt)
    except ValueError:  # a from-hf / from-megatron weights checkpoint has no step in its name
        return 0


def to_torch_cmd(a) -> str:
    from hybridpar.checkpoint.layout import optional_file_of, regular_file_of
    from hybridpar.interop.hf import TOKENIZER_FILES, write_safetensors_streaming

    ckpt = resolve_load_path(a.checkpoint)
    cfg = _config(ckpt).model
    # Only the files a checkpoint holds by name, each a regular file of it (never through a link out of it).
    extras = {"config.yaml": regular_file_of(ckpt, "config.yaml")}
    extras.update((name, f) for name in TOKENIZER_FILES if (f := optional_file_of(ckpt, name)) is not None)
    metas = _our_metas(ckpt)
    if cfg.tie_embeddings:
        metas.pop("lm_head.weight", None)

    def load_one(name):
        return load_full_model_state(ckpt, names=[name])[name]

    a.out.mkdir(parents=True, exist_ok=True)
    write_safetensors_streaming(a.out / "model.safetensors", metas, load_one)
    for name, src in extras.items():
        shutil.copyfile(src, a.out / name)
    return f"wrote {a.out}/model.safetensors ({len(metas)} tensors) and config.yaml from {ckpt}"


COMMANDS = {"to-hf": ["checkpoint"], "to-torch": ["checkpoint"], "to-megatron": ["checkpoint"],
            "from-megatron": ["megatron"], "from-hf": ["hf"]}  # and --out, always


@dataclass(frozen=True)
class Options:
    command: Literal["to-hf", "to-torch", "to-megatron", "from-megatron", "from-hf"] = doc_required(
        "what to convert: to-hf / to-torch / to-megatron from a hybridpar checkpoint, from-megatron / from-hf into one")
    out: Optional[str] = doc(None, "the directory to write (required)")
    checkpoint: Optional[str] = doc(None, "to-*: a checkpoint directory, or a run directory (its latest)")
    megatron: Optional[str] = doc(None, "from-megatron: a Megatron-LM save directory "
                                        "(latest_checkpointed_iteration.txt) or one iter_XXXXXXX directory")
    hf: Optional[str] = doc(None, "from-hf: a transformers folder (config.json + *.safetensors)")
    iteration: Optional[int] = doc(None, "to-megatron: the iteration number of the save (default: the checkpoint's "
                                         "step); from-megatron: which iteration of the save directory (its latest)")
    overwrite: bool = doc(False, "replace an existing --out")


def _parse(argv: list[str]):
    """The options, with Path values and each command's required flags checked; None after --help."""
    parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/convert_checkpoint.py",
                           positional="command")
    if parsed is None:
        return None
    a = parsed[0]
    for name in ["out", *COMMANDS[a.command]]:
        if getattr(a, name) is None:
            raise ConfigError(f"{a.command} needs --{name}; see --help")
    for name, flags in COMMANDS.items():
        extra = [f"--{f}" for f in ("checkpoint", "megatron", "hf") if getattr(a, f) is not None and f not in flags]
        if name == a.command and extra:
            raise ConfigError(f"{a.command} takes no {', '.join(extra)}; see --help")
    paths = {k: Path(getattr(a, k)) for k in ("out", "megatron", "hf") if getattr(a, k) is not None}
    return SimpleNamespace(**{**vars(a), **paths, "cmd": a.command})


def _partial_dir(final: Path) -> Path:
    """Where a conversion to `final` writes until it is published whole: named by host and process, so a later
    conversion can tell a killed one's leftovers (that process is gone) from one still running."""
    return final.with_name(f".{final.name}.partial-{socket.gethostname()}-{os.getpid()}")


def _remove_stale_partials(final: Path) -> None:
    """The .partial directories of conversions to `final` on this host whose process has exited (killed: SIGKILL
    runs no cleanup); those of other hosts (a shared file system) are left to them."""
    prefix = f".{final.name}.partial-{socket.gethostname()}-"
    for old in final.parent.glob(f".{final.name}.partial-*"):
        pid = old.name[len(prefix):] if old.name.startswith(prefix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:  # another user's live process
            continue
        shutil.rmtree(old, ignore_errors=True)
        print(f"removed {old}, left by a converter that is no longer running", file=sys.stderr)


def cli(argv: list[str]) -> int:
    # SIGTERM (a job's time limit, a scancel) unwinds like an exception, so the .partial directory is removed.
    previous = signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    try:
        a = _parse(argv)
        if a is None:
            return 0
        final = a.out
        _check_out(final, a.overwrite)
        _remove_stale_partials(final)
        a.out = _partial_dir(final)  # published whole, or not at all
        try:
            message = {"to-hf": to_hf_cmd, "from-hf": from_hf_cmd, "to-torch": to_torch_cmd,
                       "from-megatron": from_megatron_cmd, "to-megatron": to_megatron_cmd}[a.cmd](a)
            _publish(a.out, final)
        except OSError as e:  # a full or read-only file system: one line (nothing is left: see finally)
            raise write_refused(e, final, "free space there or pass another --out", paths=[a.out, final]) or e
        finally:
            shutil.rmtree(a.out, ignore_errors=True)
        message = message.replace(str(a.out), str(final))
    except ImportError as e:
        print(f"error: {e.name or e} is needed for {a.cmd}: pip install -e \".[hf]\"", file=sys.stderr)
        return 2
    except UserError as e:  # user-caused: one line; anything else keeps its traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(message)
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
