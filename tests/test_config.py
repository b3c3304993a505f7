"""Config: YAML + overrides, precedence, every validation error, the resolved dump, --help."""

from __future__ import annotations

import re

import dataclasses
import typing

import pytest
import yaml

from conftest import ROOT, run_cli
from hybridpar.config import Config
from hybridpar.config.cli import (ConfigError, all_keys, config_from_dict, dump_yaml, help_text, load_config,
                                  parse_command)
from hybridpar.models.config import doc, doc_required

REQUIRED_KEYS = ["model.name", "train.steps", "train.micro_batch_size", "train.global_batch_size", "train.seq_len",
                 "train.seed", "run.dir", "logging.interval", "parallel.tp", "parallel.dp_shard",
                 "parallel.dp_replicate", "checkpoint.interval", "data.path", "data.tokenizer", "train.precision",
                 "logging.wandb.mode"]


def test_required_field_names_exist():
    keys = set(all_keys())
    for k in REQUIRED_KEYS:
        assert k in keys, k


def test_every_field_has_a_docstring():
    checked = []

    def walk(cls, prefix=""):
        hints = typing.get_type_hints(cls)  # the annotations are strings (from __future__ import annotations)
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")
            else:
                checked.append(prefix + f.name)
    walk(Config)
    # every leaf of every section, nested ones included (the sections' own fields are checked on the way)
    assert {"model.n_layers", "optim.lr", "logging.wandb.mode", "run.dir"} <= set(checked) and len(checked) > 80
    assert sorted(checked) == sorted(all_keys())
    text = help_text()
    for k in all_keys():
        assert f"--{k} " in text, k


def test_overrides_both_forms_nested_and_bool():
    cfg = load_config(["--train.steps", "7", "--optim.lr=1e-3", "--logging.wandb.mode", "offline",
                       "--run.overwrite", "--logging.wandb.tags", "a,b", "--train.precision", "fp32"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3 and cfg.logging.wandb.mode == "offline"
    assert cfg.run.overwrite is True and cfg.logging.wandb.tags == ["a", "b"] and cfg.train.precision == "fp32"


def test_precedence_preset_then_yaml_then_cli(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: {name: gpt2-124m, n_layers: 2}\ntrain: {steps: 5, seq_len: 64}\n")
    cfg = load_config(["--config", str(f), "--train.steps", "9", "--model.d_model", "384"])
    assert cfg.model.name == "gpt2-124m" and cfg.model.vocab_size == 50304  # from the preset
    assert cfg.model.n_layers == 2 and cfg.train.seq_len == 64               # from the file
    assert cfg.train.steps == 9 and cfg.model.d_model == 384                 # from the command line


def test_resolved_dump_is_a_valid_config_file(tmp_path):
    cfg = load_config(["--model.name", "gpt-modern-1b", "--train.seq_len", "512", "--optim.schedule", "wsd"])
    f = tmp_path / "resolved.yaml"
    f.write_text(dump_yaml(cfg))
    # The file's name names the run (runs/resolved) unless the file sets run.name itself.
    assert load_config(["--config", str(f)]) == dataclasses.replace(cfg, run=dataclasses.replace(cfg.run,
                                                                                                 name="resolved"))


def test_shipped_configs_load():
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        cfg = load_config(["--config", str(f)])
        assert cfg.model.name == yaml.safe_load(f.read_text())["model"]["name"]


@pytest.mark.parametrize("argv, message", [
    (["--train.stpes", "3"], "did you mean train.steps"),
    (["--logging.wandb.mdoe", "offline"], "did you mean logging.wandb.mode"),
    (["--train.steps", "three"], "train.steps='three' is not a valid int"),
    (["--optim.lr", "fast"], "optim.lr='fast' is not a valid float"),
    (["--train.precision", "fp16"], "train.precision='fp16' is not one of fp32, bf16"),
    (["--run.overwrite", "maybe"], "run.overwrite='maybe' is not a valid bool"),
    (["--train.global_batch_size", "10", "--train.micro_batch_size", "4"], "not divisible by train.micro_batch_size=4"),
    (["--model.n_heads", "5"], "model.n_heads=5 does not divide model.d_model=128"),
    (["--train.seq_len", "512"], "train.seq_len=512 exceeds model.max_seq_len=256"),
    (["--model.name", "gpt5"], "unknown model 'gpt5'"),
    (["--optim.min_lr", "1.0"], "optim.min_lr=1.0 must be in"),
    (["--parallel.tp", "0"], "parallel.tp=0 must be a positive degree"),
    (["--data.split", "1,0,0"], "data.split='1,0,0'"),
    (["--train.steps"], "--train.steps needs a value"),
    (["stray"], "unexpected argument 'stray'"),
])
def test_errors_name_value_and_fix(argv, message):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_yaml_type_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.steps='5' is not a valid int"):
        config_from_dict({"train": {"steps": "5"}})  # YAML strings are not silently converted
    with pytest.raises(ConfigError, match="unknown config key 'trian'; did you mean train"):
        config_from_dict({"trian": {}})
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(["--config", str(bad)])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--config", str(tmp_path / "missing.yaml")])


def test_world_dependent_batch_check():
    from hybridpar.resolve import micro_batch_size_for

    cfg = load_config(["--train.global_batch_size", "32", "--train.micro_batch_size", "8"])
    assert micro_batch_size_for(cfg, 4) == 8 and cfg.grad_accum_steps(2) == 2  # 32 / (8 x 2)
    assert micro_batch_size_for(load_config(["--train.global_batch_size", "32"]), 4) == 8  # None: 32 / 4 ranks
    with pytest.raises(ValueError, match="micro_batch_size=8 x data-parallel size 3"):
        micro_batch_size_for(cfg, 3)


@pytest.mark.multiprocess
def test_cli_help_lists_fields():
    out = run_cli(["launch/pretrain_gpt.py", "--help"])
    assert out.returncode == 0
    for k in REQUIRED_KEYS:
        assert f"--{k} " in out.stdout
    assert "writes the initial weights as a seed checkpoint (step 0) and stops (default: 200)" in out.stdout


@pytest.mark.multiprocess
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli(["launch/pretrain_gpt.py", "--train.stesp", "3", "--run.dir", str(run_dir)])
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "did you mean train.steps" in out.stderr
    assert "Traceback" not in out.stderr and not run_dir.exists()


@dataclasses.dataclass(frozen=True)
class _Cluster:
    nodes: int = doc(1, "nodes")


@dataclasses.dataclass(frozen=True)
class _Options:
    mode: typing.Literal["a", "b"] = doc_required("what to do")
    input: list[str] = doc_required("files")
    json_key: str = doc("text", "key")
    append_eod: bool = doc(True, "end documents")
    limit: typing.Optional[int] = doc(None, "at most")
    cluster: _Cluster = dataclasses.field(default_factory=_Cluster)


def test_one_parser_for_every_launcher():
    """parse_command: a launcher's own flags (a dataclass), the training config's overrides beside them, and the
    same one-line errors; no launcher keeps a parser of its own."""
    argv = ["b", "--input", "x", "y", "--json-key=body", "--no-append-eod", "--cluster.nodes", "4", "--train.steps",
            "7", "--train.compile", "false", "--logging.tensorboard"]
    a, cfg = parse_command(argv, _Options, "", "t.py", config=True, positional="mode")
    assert (a.mode, a.input, a.json_key, a.append_eod, a.limit, a.cluster.nodes) == ("b", ["x", "y"], "body", False,
                                                                                     None, 4)
    assert cfg.train.steps == 7 and cfg.train.compile is False and cfg.logging.tensorboard is True
    for argv, message in [(["a", "--inptu", "x"], "unknown flag '--inptu'; did you mean --input,"),
                          (["a"], "--input is required; see --help"),
                          (["c", "--input", "x"], "'c' is not a mode; use one of a, b"),
                          (["a", "--input", "x", "--limit", "many"], "--limit='many' is not a valid int"),
                          (["a", "--input", "x", "--trian.steps", "1"], "unknown flag '--trian.steps'; did you mean "
                                                                        "--train.steps"),
                          (["a", "--input", "x", "--train.stpes", "1"], "unknown config key 'train.stpes'")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_command(argv, _Options, "", "t.py", config=True, positional="mode")
    launchers = sorted((ROOT / "launch").glob("*.py"))
    assert len(launchers) == 13 and not [p.name for p in launchers if "argparse" in p.read_text()]


def test_numbers_out_of_range_are_one_line_errors(tmp_path):
    """Values that reached numpy, torch or timedelta as tracebacks: refused when the config is read."""
    for argv, message in [(["--train.seed", "-1"], "train.seed=-1 must be in [0, 2**32)"),
                          (["--train.seed", str(2**32)], "train.seed=4294967296 must be in [0, 2**32)"),
                          (["--parallel.timeout_minutes", "1e300"], "must be in (0, 43200] (30 days)"),
                          (["--data.split", "nan,5,0"], "data.split='nan,5,0': give three weights"),
                          (["--data.split", "inf,5,0"], "data.split='inf,5,0': give three weights"),
                          (["--model.init_std", "-1"], "model.init_std=-1.0 must be a positive number"),
                          (["--data.path", ""], "data.path='' names no data"),
                          (["--optim.muon_lr", "1e30"], "optim.muon_lr=1e+30 is above 10: such a step overflows"),
                          (["--optim.lr", "50"], "optim.lr=50.0 is above 10"),
                          (["--optim.muon_ns_steps", "1000000"], "optim.muon_ns_steps=1000000 is above 100: each "
                                                                 "iteration is three matmuls"),
                          (["--spike.lr_scale", "1e300"], "spike.lr_scale=1e+300 must be in (0, 1]"),
                          (["--logging.wandb.id", "../x"], "logging.wandb.id='../x': a W&B run id is 1-128"),
                          (["--logging.wandb.id", ".."], "logging.wandb.id='..': a W&B run id")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(argv)
    from hybridpar.data.dataset import load_data_tokenizer

    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir=.* is a file; give a directory"):
        load_data_tokenizer(load_config(["--data.cache_dir", str(tmp_path / "file")]).data)


def test_config_files_a_careless_edit_breaks_are_one_line_errors(tmp_path):
    """A key given twice (the last silently won), a section that is a scalar (read as empty: the defaults ran), a
    file that is not UTF-8 (a traceback), and a run name that would write outside runs/."""
    cases = [(b"train:\n  steps: 3\n  steps: 5\n", "is not valid YAML: key 'steps' is given twice"),
             (b"train: 0\n", "section train: 0 is not a mapping"), (b'train: ""\n', "section train: '' is not a mapping"),
             (b"train:\n  steps: 3 \xff\n", "is not UTF-8 text (byte 18); save it as UTF-8")]
    for i, (text, message) in enumerate(cases):
        (tmp_path / f"{i}.yaml").write_bytes(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(["--config", str(tmp_path / f"{i}.yaml")])
        # also when the command line sets a field of that section (its values used to replace the scalar)
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(["--config", str(tmp_path / f"{i}.yaml"), "--train.steps", "4"])
    (tmp_path / "nested.yaml").write_text("logging:\n  wandb: 0\n")
    with pytest.raises(ConfigError, match=re.escape("logging.wandb: 0 in the --config file is not a mapping")):
        load_config(["--config", str(tmp_path / "nested.yaml"), "--logging.wandb.mode", "disabled"])
    for name in ("../x", "a/b", "..", "."):
        with pytest.raises(ConfigError, match=re.escape(f"run.name={name!r} must be a plain name")):
            load_config(["--run.name", name])
    assert load_config(["--run.name", "my-run_2"]).run.name == "my-run_2"
