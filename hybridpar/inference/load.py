"""A trained model on any layout, from any checkpoint hybridpar reads, through the trainer's own start-up path.

Sources: a run dir (its latest complete checkpoint), a DCP checkpoint directory (any layout it was saved with;
also what convert_checkpoint.py from-hf / from-megatron write), or a weights-only export (model.safetensors +
config.yaml, convert_checkpoint.py to-torch). The model is the one the source's config.yaml describes, checked
against its tensors; the layout, precision and device are this command's (parallel.* and train.* flags): the
checkpoint's saved degrees belong to the world that trained it. The model is built on the meta device,
parallelised, and each rank reads only its shards (DCP), or takes them from the export's full tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from hybridpar.checkpoint.dcp import check_config_matches_tensors, load_model_weights
from hybridpar.checkpoint.layout import resolve_load_path
from hybridpar.checkpoint.resume_checks import read_checkpoint_config
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.errors import CheckpointError, ConfigError

EXPORT_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class Source:
    path: Path  # the checkpoint or export directory
    kind: str  # "dcp" or "export"
    saved: dict  # its config.yaml


def find_source(path: str) -> Source:
    """What `path` names: an export directory, else a checkpoint or run directory (CheckpointError otherwise)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {path!r} does not exist; give a run dir, a checkpoint dir or an export")
    kind = "export" if (p / EXPORT_WEIGHTS).is_file() else "dcp"
    if kind == "dcp":
        p = resolve_load_path(path)
    saved = read_checkpoint_config(p)
    if saved is None:
        raise CheckpointError(f"{p} has no config.yaml; it was not written by hybridpar (for a transformers folder "
                              f"run convert_checkpoint.py from-hf first)")
    return Source(p, kind, saved)


def source_tokenizer(src: Source, spec: str | None = None):
    """The tokenizer saved with the checkpoint (tokenizer.json, tokenizer.model or tokenizer.txt), else `spec`,
    else the config's data.tokenizer when it names files rather than training on the corpus. A `spec` that encodes
    otherwise than the saved tokenizer is refused (a one-line ConfigError)."""
    from hybridpar.checkpoint.layout import optional_file_of
    from hybridpar.data.tokenizer import load_tokenizer

    found = None
    for name, kind in (("tokenizer.json", "bpe"), ("tokenizer.model", "sentencepiece")):
        path = optional_file_of(src.path, name)  # never through a link out of the checkpoint
        if path is not None:
            found = load_tokenizer(f"{kind}:{path}")
            break
    if found is None and (src.path / "tokenizer.txt").is_file():
        found = load_tokenizer("bytes")
    if spec:
        given = load_tokenizer(spec)
        if found is not None and given.fingerprint != found.fingerprint:
            raise ConfigError(f"--tokenizer {spec} is not the tokenizer {src.path} was trained with ({found.spec}, "
                              f"saved with it): its ids would mean other text; drop --tokenizer")
        return given
    if found is not None:
        return found
    saved = (src.saved.get("data") or {}).get("tokenizer", "")
    if saved and not str(saved).startswith("train-bpe"):
        return load_tokenizer(saved)
    raise ConfigError(f"{src.path} holds no tokenizer file; pass --tokenizer SPEC (bytes, bpe:PATH, gpt2:DIR, "
                      f"sentencepiece:MODEL)")


def inference_config(src: Source, cfg):
    """The source's model in `cfg` (this command's parallel and train settings): the vocabulary stays the
    checkpoint's (not re-padded for this tp), and the training-memory refusal is off (no optimizer state or
    activations for backward here)."""
    from dataclasses import replace

    from hybridpar.models import MODEL_FIELDS, ModelConfig

    fields = src.saved.get("model")
    if not isinstance(fields, dict):
        raise CheckpointError(f"{src.path}/config.yaml has no model section; restore the run's config.yaml")
    try:
        model = ModelConfig(**{k: v for k, v in fields.items() if k in MODEL_FIELDS and k != "vocab_from_tokenizer"},
                            vocab_from_tokenizer=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{src.path}/config.yaml: its model section is not valid ({e}); restore the run's "
                              f"config.yaml") from None
    seq_len = min(int((src.saved.get("train") or {}).get("seq_len", model.max_seq_len)), model.max_seq_len)
    cfg = replace(cfg, model=model, train=replace(cfg.train, seq_len=seq_len, memory_check=False))
    if src.kind == "dcp":
        check_config_matches_tensors(src.path, cfg.model)
    return cfg


def load_weights(model: nn.Module, src: Source) -> None:
    """The source's weights into the parallelised `model` (each rank its shards)."""
    if src.kind == "dcp":
        return load_model_weights(model, src.path)
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    try:
        full = load_file(str(src.path / EXPORT_WEIGHTS))  # tensors only: no code can be in it
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{src.path / EXPORT_WEIGHTS} is not a readable safetensors file ({e}); export it "
                              f"again") from None
    want = get_model_state_dict(model)
    if "lm_head.weight" in want and "lm_head.weight" not in full and "tok_embeddings.weight" in full:
        full["lm_head.weight"] = full["tok_embeddings.weight"]  # tied: exported once
    for name, t in want.items():
        if name not in full or tuple(full[name].shape) != tuple(t.shape):
            found = "is missing" if name not in full else f"has shape {list(full[name].shape)}"
            raise CheckpointError(f"{src.path / EXPORT_WEIGHTS} holds a different model: {name} {found}, its "
                                  f"config.yaml's is {list(t.shape)}")
    extra = sorted(set(full) - set(want))
    if extra:
        raise CheckpointError(f"{src.path / EXPORT_WEIGHTS} holds {extra[0]} that its config.yaml's model lacks")
    set_model_state_dict(model, {k: full[k] for k in want},
                         options=StateDictOptions(full_state_dict=True, strict=True))


@dataclass
class Loaded:
    model: nn.Module
    run: object  # hybridpar.resolve.Run
    mesh: object
    tokenizer: Tokenizer
    source: Source

    @property
    def autocast(self):
        """The forward's context, as the trainer's (hybridpar.parallel.autocast_for)."""
        from hybridpar.parallel import autocast_for

        return autocast_for(self.model, self.run.cfg.train.precision, self.run.device)


def load_for_inference(path: str, cfg, tokenizer_spec: str | None = None) -> Loaded:
    """The model of checkpoint `path` on this world's layout, with `cfg`'s parallel and train settings: process
    group, resolve, mesh and model exactly as the trainer starts them, then the weights."""
    from hybridpar.parallel.distributed import init_mesh
    from hybridpar.parallel.startup import build_parallel_model
    from hybridpar.resolve import begin

    src = find_source(path)
    tokenizer = source_tokenizer(src, tokenizer_spec)
    run = begin(inference_config(src, cfg), tokenizer=tokenizer)
    if tokenizer.vocab_size > run.cfg.model.vocab_size:
        raise CheckpointError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model of {src.path} only "
                              f"{run.cfg.model.vocab_size}: not the tokenizer it was trained with")
    mesh = init_mesh(run.layout.degrees, run.device)
    model = build_parallel_model(run.cfg, mesh, run.device, init=False)
    load_weights(model, src)
    return Loaded(model.eval(), run, mesh, tokenizer, src)
