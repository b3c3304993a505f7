"""Export and import: hybridpar checkpoints <-> transformers (GPT2LMHeadModel, LlamaForCausalLM) with equal logits,
and the consolidated safetensors export with load_pretrained. transformers from PyPI, random small configs, offline."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import launcher, run_cli
from hybridpar.checkpoint.dcp import load_full_model_state
from hybridpar.checkpoint.layout import MARKER
from hybridpar.config import Config, TrainConfig
from hybridpar.config.cli import dump_yaml
from hybridpar.models import build_model, get_model_config, load_pretrained

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.multiprocess]  # every test here starts processes

CONFIGS = {
    "gpt2": dict(name="tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=384, max_seq_len=32),
    "llama": dict(name="gpt-modern-1b", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden_size=160,
                  vocab_size=384, max_seq_len=32, rope_theta=10000.0),
}


def _checkpoint(tmp_path, family, **overrides):
    """A hybridpar checkpoint directory (DCP + config.yaml + marker) of a randomly initialised model."""
    torch.manual_seed(0)
    name, fields = CONFIGS[family]["name"], {k: v for k, v in {**CONFIGS[family], **overrides}.items() if k != "name"}
    model_cfg = get_model_config(name, **fields)
    model = build_model(model_cfg, device="cpu")
    with torch.no_grad():  # make every tensor matter (norm gains and biases are 1 and 0 at init)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ckpt = tmp_path / "ckpt"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "config.yaml").write_text(dump_yaml(Config(model=model_cfg, train=TrainConfig(seq_len=32))))
    (ckpt / MARKER).write_text("test\n")
    return model.eval(), ckpt


@pytest.mark.parametrize("family, arch", [("gpt2", "GPT2LMHeadModel"), ("llama", "LlamaForCausalLM")])
def test_to_hf_and_back(tmp_path, family, arch):
    from transformers import AutoModelForCausalLM

    model, ckpt = _checkpoint(tmp_path, family)
    out = run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")])
    assert out.returncode == 0, out.stderr
    # the run's end of document (the byte tokenizer's 0) as eos, and no warning about GPT-2's 50256 on the way
    assert "within the vocabulary" not in out.stderr + out.stdout, out.stderr
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == arch
    ids = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4

    back = run_cli(["launch/convert_checkpoint.py", "from-hf", "--hf", str(tmp_path / "hf"), "--out",
                    str(tmp_path / "back")])
    assert back.returncode == 0, back.stderr
    original, restored = load_full_model_state(ckpt), load_full_model_state(tmp_path / "back")
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[k], restored[k]) for k in original)


def test_from_hf_native_llama_matches_its_logits(tmp_path):
    """A model initialised by transformers itself (not one hybridpar exported) imports with equal logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    out = run_cli(["launch/convert_checkpoint.py", "from-hf", "--hf", str(tmp_path / "hf"), "--out",
                   str(tmp_path / "ck")])
    assert out.returncode == 0, out.stderr
    run_cli_export = run_cli(["launch/convert_checkpoint.py", "to-torch", "--checkpoint", str(tmp_path / "ck"),
                              "--out", str(tmp_path / "pt")])
    assert run_cli_export.returncode == 0, run_cli_export.stderr
    ours = load_pretrained(tmp_path / "pt")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < 1e-4


def test_to_torch_and_load_pretrained(tmp_path):
    model, ckpt = _checkpoint(tmp_path, "gpt2")
    out = run_cli(["launch/convert_checkpoint.py", "to-torch", "--checkpoint", str(ckpt), "--out",
                   str(tmp_path / "pt")])
    assert out.returncode == 0, out.stderr
    from safetensors import safe_open
    with safe_open(str(tmp_path / "pt" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "tok_embeddings.weight" in f.keys()  # tied: stored once
    loaded = load_pretrained(tmp_path / "pt")
    ids = torch.randint(0, 384, (2, 32))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_conversion_errors(tmp_path):
    _, ckpt = _checkpoint(tmp_path, "gpt2", position="rope")  # GPT-2 blocks with RoPE: no transformers class
    out = run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "x")])
    assert out.returncode == 2 and "matches neither GPT2LMHeadModel nor LlamaForCausalLM" in out.stderr
    assert not (tmp_path / "x").exists()
    out = run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(tmp_path / "nothing"), "--out",
                   str(tmp_path / "x")])
    assert out.returncode == 2 and "neither a complete checkpoint nor a run directory" in out.stderr


def test_no_export_follows_a_link_out_of_its_source(tmp_path, capsys):
    """A checkpoint's tokenizer.json (or an HF folder's) that links to a file outside it is refused in one line and
    nothing is written: it was copied, and a link to a local secret landed in the export."""
    secret = tmp_path / "secret.txt"
    secret.write_text("api-key\n")
    model, ckpt = _checkpoint(tmp_path, "gpt2")
    (ckpt / "tokenizer.json").symlink_to(secret)
    out = run_cli(["launch/convert_checkpoint.py", "to-torch", "--checkpoint", str(ckpt), "--out",
                   str(tmp_path / "pt")])
    assert out.returncode == 2 and "tokenizer.json is not a regular file of" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "pt").exists()
    capsys.readouterr()
    code = launcher("convert_checkpoint").cli(["to-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "h")])
    err = capsys.readouterr().err  # (in this process: the refusal is the converter's, not the interpreter's)
    assert code == 2 and "tokenizer.json is not a regular file of" in err, err
    assert "Traceback" not in err and not (tmp_path / "h").exists()
    from hybridpar.errors import CheckpointError
    from hybridpar.inference.load import find_source, source_tokenizer

    with pytest.raises(CheckpointError, match="tokenizer.json is not a regular file of"):  # generate.py, evaluate.py
        source_tokenizer(find_source(str(ckpt)))
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.txt").write_text("bytes\n")  # a regular tokenizer file is copied
    assert run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out",
                    str(tmp_path / "hf")]).returncode == 0
    (tmp_path / "hf" / "tokenizer.json").unlink(missing_ok=True)
    (tmp_path / "hf" / "tokenizer.json").symlink_to(secret)
    out = run_cli(["launch/convert_checkpoint.py", "from-hf", "--hf", str(tmp_path / "hf"), "--out",
                   str(tmp_path / "back")])
    assert out.returncode == 2 and "tokenizer.json is not a regular file of" in out.stderr, out.stderr
    assert not (tmp_path / "back").exists()
    out = run_cli(["launch/convert_checkpoint.py", "to-torch", "--checkpoint", str(ckpt), "--out",
                   str(tmp_path / "pt")])
    assert out.returncode == 0 and (tmp_path / "pt" / "tokenizer.txt").read_text() == "bytes\n", out.stderr


def test_from_hf_checks_config_json_against_the_weights(tmp_path):
    """A config.json that disagrees with the tensors is one line naming the first tensor that does not fit; each of
    these wrote a broken or truncated checkpoint at exit 0 (n_layer 1 dropped a block, n_embd dropped wv)."""
    _, ckpt = _checkpoint(tmp_path, "gpt2")
    assert run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out",
                    str(tmp_path / "hf")]).returncode == 0
    good = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, message in [({"n_layer": 1}, "transformer.h.1."), ({"n_embd": 32, "n_head": 2}, "comes out as [384, 64] but the model config.json describes needs [384, 32]"),
                            ({"vocab_size": 500}, "tok_embeddings.weight comes out as [384, 64] but the model")]:
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**good, **change}))
        out = run_cli(["launch/convert_checkpoint.py", "from-hf", "--hf", str(tmp_path / "hf"), "--out",
                       str(tmp_path / "back")])
        assert out.returncode == 2 and message in out.stderr and "disagree" in out.stderr, (change, out.stderr)
        assert "Traceback" not in out.stderr and not (tmp_path / "back").exists()


def test_from_hf_refuses_integer_and_non_finite_weights(tmp_path):
    """Weights of an integer dtype, or holding a NaN or an inf, were taken as given (a checkpoint at exit 0)."""
    from safetensors.torch import load_file, save_file

    _, ckpt = _checkpoint(tmp_path, "gpt2")
    assert run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out",
                    str(tmp_path / "hf")]).returncode == 0
    weights = tmp_path / "hf" / "model.safetensors"
    good = load_file(str(weights))
    name = "transformer.h.0.mlp.c_fc.weight"
    nan = good[name].clone()
    nan[3, 5] = float("nan")
    inf = good[name].clone()
    inf[0, 0] = float("-inf")
    for bad, message in [(good[name].to(torch.int64), f"{name} holds int64 values, not weights"),
                         (nan, f"{name} holds NaN or infinite values"), (inf, f"{name} holds NaN or infinite")]:
        save_file({**good, name: bad}, str(weights))
        out = run_cli(["launch/convert_checkpoint.py", "from-hf", "--hf", str(tmp_path / "hf"), "--out",
                       str(tmp_path / "back")])
        assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert not (tmp_path / "back").exists()


def test_exports_check_config_yaml_against_the_tensors(tmp_path, capsys):
    """An edited config.yaml (more or fewer blocks, another width) no longer describes the saved tensors: every
    export refuses in one line (to-hf wrote a folder transformers refuses, or dropped the extra blocks). The
    converter's own entry point, in this process."""
    import sys

    import yaml

    from conftest import ROOT

    sys.path.insert(0, str(ROOT / "launch"))
    import convert_checkpoint

    _, ckpt = _checkpoint(tmp_path, "gpt2")
    good = yaml.safe_load((ckpt / "config.yaml").read_text())
    for change, message in [({"n_layers": 1}, "holds layers.1.attn.wk.bias (and 15 more tensors) that its config"),
                            ({"n_layers": 3}, "model.layers.2.attn_norm.weight is missing"),
                            ({"d_model": 128}, "model.tok_embeddings.weight has shape [384, 64], this run's is")]:
        (ckpt / "config.yaml").write_text(yaml.safe_dump({**good, "model": {**good["model"], **change}}))
        for cmd in ("to-hf", "to-torch", "to-megatron"):
            assert convert_checkpoint.cli([cmd, "--checkpoint", str(ckpt), "--out", str(tmp_path / cmd)]) == 2
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
            assert not (tmp_path / cmd).exists()


def test_full_disks_and_killed_writers_leave_nothing(tmp_path):
    """Writers onto a full file system (a real 64 KiB tmpfs in a mount namespace of this test's own): to-torch (the
    weights are ~150 KiB) and preprocess_data.py (a 200 KiB corpus) each end in one line and exit 2, leaving neither
    their output nor a temporary file there (out.bin.tmp and a traceback before). A converter killed with -9 left its
    .partial directory: the next conversion to that name removes it."""
    _, ckpt = _checkpoint(tmp_path, "gpt2")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a corpus larger than the disk\n" for i in range(5000)))
    full = tmp_path / "full"
    full.mkdir()
    py = f"{__import__('sys').executable}"
    script = (f"mount -t tmpfs -o size=64k tmpfs {full} || exit 9; "
              f"{py} launch/convert_checkpoint.py to-torch --checkpoint {ckpt} --out {full}/pt; echo rc=$?; "
              f"{py} launch/preprocess_data.py --input {corpus} --tokenizer bytes --output-prefix {full}/data/c; "
              f"echo rc=$?; ls -AR {full}")
    out = run_cli(["-c", f"import subprocess, sys; sys.exit(subprocess.call(['unshare', '--mount', "
                         f"'--propagation', 'private', 'sh', '-c', {script!r}]))"])
    assert out.returncode == 0 and out.stdout.count("rc=2") == 2, (out.stdout, out.stderr)
    listing = out.stdout.split("rc=2")[-1].split()
    assert listing in ([f"{full}:", "data", f"{full}/data:"], [f"{full}:"]), out.stdout  # nothing else left
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 2 and "Traceback" not in out.stderr, out.stderr
    assert errors[0] == f"error: writing {full}/pt: no space left on device; free space there or pass another --out"
    assert errors[1] == (f"error: writing {full}/data/c.bin/.idx: no space left on device; free space there or pass "
                         f"another --output-prefix")
    # a converter killed mid-write (its .partial directory, named by a process that has exited) and one still
    # running (this process's pid): the first is removed by the next conversion, the second left alone
    import subprocess
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = __import__("socket").gethostname()
    stale, live = tmp_path / f".pt.partial-{host}-{dead.pid}", tmp_path / f".pt.partial-{host}-{os.getpid()}"
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors.tmp").write_bytes(b"\0" * 100)
    out = run_cli(["launch/convert_checkpoint.py", "to-torch", "--checkpoint", str(ckpt), "--out",
                   str(tmp_path / "pt")])
    assert out.returncode == 0 and not stale.exists() and live.exists(), out.stderr
    assert f"removed {stale}, left by a converter that is no longer running" in out.stderr
