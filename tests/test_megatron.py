"""Megatron-LM interop against megatron-core itself: its GPTModel (CPU, local layer spec) saves torch_dist and legacy
torch checkpoints (legacy split over 2 tensor-parallel ranks), `from-megatron` imports them and hybridpar's GPT gives
megatron-core's logits; `to-megatron` writes a save that megatron-core's dist_checkpointing loads into a fresh
GPTModel with the same logits. Hostile and unsupported inputs get one line and write nothing."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import socket
import sys
from argparse import Namespace

import pytest
import torch

from conftest import ROOT, run_cli
from hybridpar.checkpoint.dcp import load_full_model_state
from hybridpar.config.cli import config_from_dict
from hybridpar.models import build_model
from hybridpar.checkpoint.resume_checks import read_checkpoint_config
from hybridpar.checkpoint.safe_load import INERT_CLASSES

sys.path.insert(0, str(ROOT / "tests"))
from megatron_harness import ITERATION, token_ids  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.multiprocess]  # every test here starts processes
HARNESS = "tests/megatron_harness.py"
_spec = importlib.util.spec_from_file_location("convert_cli", ROOT / "launch" / "convert_checkpoint.py")
convert_cli = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = convert_cli  # its dataclasses look their module up there
_spec.loader.exec_module(convert_cli)


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _harness(*args, nproc: int = 1):
    import os

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": _port()}
    cmd = ([HARNESS, *args] if nproc == 1 else
           ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", HARNESS, *args])
    out = run_cli(cmd, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    """megatron-core saves: {(spec, format): save dir}, each with the logits of megatron-core's forward."""
    root = tmp_path_factory.mktemp("megatron")
    made = {}
    for spec, fmt in [("gpt", "torch_dist"), ("modern", "torch_dist"), ("mixed", "torch_dist"), ("gpt", "legacy"),
                      ("modern", "legacy")]:
        d = root / f"{spec}-{fmt}"
        _harness("save" if fmt == "torch_dist" else "save-legacy", spec, str(d), nproc=1 if fmt == "torch_dist" else 2)
        made[(spec, fmt)] = d
    return made


def _convert(*args):
    return run_cli(["launch/convert_checkpoint.py", *map(str, args)])


def _our_logits(ckpt) -> torch.Tensor:
    """Logits of hybridpar's GPT built from a converted checkpoint's config.yaml and weights, as a user would."""
    cfg = config_from_dict(read_checkpoint_config(ckpt)).model
    model = build_model(cfg, "cpu", init=False)
    model.init_buffers()
    model.load_state_dict(load_full_model_state(ckpt))
    with torch.no_grad():
        return model.eval()(token_ids(cfg.vocab_size))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("spec, fmt", [("gpt", "torch_dist"), ("modern", "torch_dist"), ("mixed", "torch_dist"),
                                       ("gpt", "legacy"), ("modern", "legacy")])
def test_from_megatron_gives_megatron_logits(saves, tmp_path, spec, fmt):
    src = saves[(spec, fmt)]
    out = _convert("from-megatron", "--megatron", src, "--out", tmp_path / "ours")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"iter_{ITERATION:07d}" in out.stdout and ("legacy, 2 tensor-parallel" in out.stdout) == (fmt == "legacy")
    reference = _load_tensor(src / "logits.pt")
    assert _rel(_our_logits(tmp_path / "ours"), reference) < 1e-4
    saved = read_checkpoint_config(tmp_path / "ours")  # Megatron-LM's training flags carried over
    train, optim = saved["train"], saved["optim"]
    assert (train["global_batch_size"], train["micro_batch_size"], train["steps"], optim["lr"]) == (8, 2, 100, 3e-4)
    assert saved["model"]["n_layers"] == (3 if spec == "mixed" else 2)


@pytest.mark.parametrize("spec", ["gpt", "modern", "mixed"])
def test_to_megatron_loads_in_megatron_core(saves, tmp_path, spec):
    src = saves[(spec, "torch_dist")]
    assert _convert("from-megatron", "--megatron", src, "--out", tmp_path / "ours").returncode == 0
    out = _convert("to-megatron", "--checkpoint", tmp_path / "ours", "--out", tmp_path / "back", "--iteration", 42)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "back" / "latest_checkpointed_iteration.txt").read_text() == "42"
    _harness("load", str(tmp_path / "back" / "iter_0000042"))  # megatron-core builds from the args and loads
    assert _rel(_load_tensor(tmp_path / "back" / "logits.pt"), _load_tensor(src / "logits.pt")) < 1e-4


def _load_tensor(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_legacy_part(path):
    """A legacy model_optim_rng.pt the harness saved, read to be edited and saved again: weights-only, allowing
    argparse.Namespace and the Megatron-LM classes hybridpar reads inertly (here the real classes, so that the
    saved-again file holds what megatron-core wrote), each checked against that list first."""
    allowed = [Namespace]
    for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
        if name != "argparse.Namespace":
            assert name in INERT_CLASSES, name
            module, cls = name.rsplit(".", 1)
            allowed.append(getattr(importlib.import_module(module), cls))
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)


def test_layernorm_1p_gains_are_restored(saves, tmp_path):
    """--apply-layernorm-1p stores gain - 1: the same model saved that way imports to the same logits."""
    src = saves[("gpt", "legacy")]
    dst = tmp_path / "m1p" / f"iter_{ITERATION:07d}"
    for rank in (0, 1):
        part = _load_legacy_part(src / f"iter_{ITERATION:07d}" / f"mp_rank_0{rank}" / "model_optim_rng.pt")
        part["args"].apply_layernorm_1p = True
        part["model"] = {k: v - 1 if "layernorm.weight" in k else v for k, v in part["model"].items()}
        (dst / f"mp_rank_0{rank}").mkdir(parents=True)
        torch.save(part, dst / f"mp_rank_0{rank}" / "model_optim_rng.pt")
    assert _convert("from-megatron", "--megatron", dst, "--out", tmp_path / "ours").returncode == 0
    assert _rel(_our_logits(tmp_path / "ours"), _load_tensor(src / "logits.pt")) < 1e-4


class _Payload:
    def __reduce__(self):
        return (print, ("PWNED",))


def _copy_legacy(saves, tmp_path, edit_args=None, edit_part=None):
    src = saves[("gpt", "legacy")] / f"iter_{ITERATION:07d}"
    dst = tmp_path / "edited" / src.name
    for rank in (0, 1):
        part = _load_legacy_part(src / f"mp_rank_0{rank}" / "model_optim_rng.pt")
        if edit_args:
            edit_args(part["args"])
        if edit_part:
            edit_part(part, rank)
        (dst / f"mp_rank_0{rank}").mkdir(parents=True)
        torch.save(part, dst / f"mp_rank_0{rank}" / "model_optim_rng.pt")
    return dst


def _refused(capsys, src, tmp_path, *expected, extra=()):
    """The command line's own entry point, in this process (capsys sees anything a payload would print)."""
    out_dir = tmp_path / "out"
    capsys.readouterr()
    rc = convert_cli.cli(["from-megatron", "--megatron", str(src), "--out", str(out_dir), *extra])
    out, err = capsys.readouterr()
    assert rc == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(e in err for e in expected), err
    assert "PWNED" not in out + err and not out_dir.exists()


def test_hostile_and_unsupported_megatron_saves_are_refused(saves, tmp_path, capsys):
    (tmp_path / "a").mkdir()
    # pickled code in the args of a legacy save, and in torch_dist's common.pt
    _refused(capsys, _copy_legacy(saves, tmp_path / "a", edit_args=lambda a: setattr(a, "x", _Payload())),
             tmp_path / "a", "builtins.print", "not plain data")
    dist_src = saves[("modern", "torch_dist")] / f"iter_{ITERATION:07d}"
    poisoned = tmp_path / "b" / dist_src.name
    shutil.copytree(dist_src, poisoned)
    torch.save({"args": Namespace(num_layers=_Payload())}, poisoned / "common.pt")
    _refused(capsys, poisoned, tmp_path / "b", "common.pt", "builtins.print")
    # truncated .pt, a missing tensor-parallel rank, arguments hybridpar's GPT does not have
    trunc = _copy_legacy(saves, tmp_path / "c")
    f = trunc / "mp_rank_01" / "model_optim_rng.pt"
    f.write_bytes(f.read_bytes()[:2000])
    _refused(capsys, trunc, tmp_path / "c", "mp_rank_01", "cannot be read")
    lost = _copy_legacy(saves, tmp_path / "d")
    shutil.rmtree(lost / "mp_rank_01")
    _refused(capsys, lost, tmp_path / "d", "--tensor-model-parallel-size=2", "incomplete")
    for arg, value, flag in [("num_experts", 8, "--num-experts=8"), ("rotary_percent", 0.5, "--rotary-percent=0.5"),
                             ("kv_channels", 8, "--kv-channels=8"), ("normalization", "Foo", "--normalization='Foo'"),
                             # args the tensors contradict, refused before anything is built (10^9 layers grew
                             # memory without bound)
                             ("num_layers", 10**9, "--num-layers=1000000000 but the saved tensors hold"),
                             ("hidden_size", 48, "--hidden-size=48 but the saved tensors hold")]:
        d = tmp_path / f"e-{arg}"
        _refused(capsys, _copy_legacy(saves, d, edit_args=lambda a: setattr(a, arg, value)), d, flag)
    # the same in a torch_dist save: its common.pt's args say 10^9 layers over the saved blocks
    absurd = tmp_path / "h" / f"iter_{ITERATION:07d}"
    shutil.copytree(saves[("gpt", "torch_dist")] / absurd.name, absurd)
    args = _load_legacy_part(saves[("gpt", "legacy")] / absurd.name / "mp_rank_00" / "model_optim_rng.pt")["args"]
    torch.save({"args": Namespace(**{**vars(args), "num_layers": 10**9})}, absurd / "common.pt")
    _refused(capsys, absurd, tmp_path / "h", "--num-layers=1000000000 but the saved tensors hold")
    # a save directory without that iteration; a non-empty --out
    _refused(capsys, saves[("gpt", "torch_dist")], tmp_path / "f", "iter_0000003 does not exist (found: iter_0000007)",
             extra=("--iteration", "3"))
    (tmp_path / "g" / "out").mkdir(parents=True)
    (tmp_path / "g" / "out" / "keep.txt").write_text("mine")
    rc = convert_cli.cli(["from-megatron", "--megatron", str(saves[("gpt", "torch_dist")]), "--out",
                          str(tmp_path / "g" / "out")])
    assert rc == 2 and "not empty" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "g" / "out").iterdir()] == ["keep.txt"]


def test_a_damaged_iteration_tracker_is_one_line(tmp_path):
    """latest_checkpointed_iteration.txt holds a number or "release": 5,000 digits (int() refuses past 4,300), a word,
    an endless file and a missing iter directory are each a CheckpointError naming what to pass instead."""
    from hybridpar.checkpoint.safe_load import CheckpointError
    from hybridpar.interop.megatron import resolve_iteration_dir

    (tmp_path / "iter_0000042").mkdir()
    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("42\n")
    assert resolve_iteration_dir(tmp_path) == tmp_path / "iter_0000042"
    for text, message in [("9" * 5000, "holds '9999"), ("note", "holds 'note', not an iteration number"),
                          ("٤٢", "not an iteration number"), ("7", r"iter_0000007 does not exist \(found: iter_0000042\)")]:
        tracker.write_text(text)
        with pytest.raises(CheckpointError, match=message) as e:
            resolve_iteration_dir(tmp_path)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300
    tracker.unlink()
    tracker.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is not a regular file; pass"):
        resolve_iteration_dir(tmp_path)
