"""The one command-line parser of every launcher, and the config from YAML and `--section.field VALUE` overrides,
with one-line errors that name the value and the fix. Precedence, lowest first: dataclass defaults, the model.name
preset, the --config file, the command line; the resolved config dumps to a valid --config file. A launcher's own
flags are a dataclass of doc() fields (parse_command): --json-key at the top level, --cluster.gpus_per_node nested.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from hybridpar.config import Config
from hybridpar.errors import ConfigError
from hybridpar.models import get_model_config
from hybridpar.models.config import ModelConfig


class _CliValue(str):
    """A value typed on the command line: text to parse. YAML values arrive typed and are not re-parsed."""


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_hints = typing.get_type_hints  # a dataclass's field name -> type


_UNIONS = (Union, types.UnionType)


def _type_name(tp) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(map(str, args))
    if origin in _UNIONS:
        return " | ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _convert(key: str, value: Any, tp) -> Any:
    """Convert a YAML value or a command-line string to the field's type, or raise ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    from_cli = isinstance(value, _CliValue)
    fail = ConfigError(f"{key}={value!r} is not a valid {_type_name(tp)}")
    if origin in _UNIONS:  # Optional[X], X | None
        inner = [a for a in args if a is not type(None)]
        if from_cli and value.strip() in ("", "[]") and any(typing.get_origin(a) is list for a in inner):
            return []  # an empty list given: none (not the default None stands for)
        if value is None or (from_cli and value.lower() in ("none", "null", "")):
            return None
        if len(inner) == 1:
            return _convert(key, value, inner[0])
        for a in inner:
            try:
                return _convert(key, value, a)
            except ConfigError:
                pass
        raise fail
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, args))}")
        return str(value)
    if origin is list:
        items = [v.strip() for v in value.strip("[]").split(",") if v.strip()] if from_cli else value
        if not isinstance(items, list):
            raise fail
        return [_convert(key, _CliValue(v) if from_cli else v, args[0]) for v in items]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise fail
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                pass
        raise fail
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif from_cli:
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise fail
        if not math.isfinite(number):  # no setting of hybridpar means anything at inf or nan
            raise ConfigError(f"{key}={value!r} must be a finite number")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise fail
    raise fail


def _unknown(key: str, valid: list[str], what: str = "config key") -> ConfigError:
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "see --help for the valid names"
    return ConfigError(f"unknown {what} {key!r}; {hint}")


def all_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every leaf key, dotted (e.g. 'logging.wandb.mode')."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _build(cls, values: dict, prefix: str, valid=all_keys):
    """Instantiate dataclass `cls` from a nested dict whose leaves are YAML values or CLI strings."""
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {values!r}")
    hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise _unknown(prefix + key, valid())
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, {} if value is None else value, f"{prefix}{key}.", valid)
        else:
            kwargs[key] = _convert(prefix + key, value, tp)
    try:
        return cls(**kwargs)
    except TypeError:  # a required field of a launcher's options
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in kwargs
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        raise ConfigError(f"{_flag(prefix + missing[0])} is required; see --help") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _flag(key: str) -> str:
    """How a launcher option is spelt: --json-key for a top-level field, --cluster.gpus_per_node when nested."""
    key = key.removeprefix("--")
    return "--" + (key if "." in key else key.replace("_", "-"))


def _field_type(cls, dotted: str):
    for part in dotted.split(".")[:-1]:
        cls = _hints(cls)[part]
    return _hints(cls).get(dotted.split(".")[-1])


def parse_command(argv: list[str], options: type, about: str, prog: str, config: bool = False,
                  positional: str | None = None):
    """A launcher's command line: its own flags (dataclass `options`: a list takes the values up to the next flag,
    a lone bool flag is true and --no-FLAG false, a field without default is required), with config every other
    --section.field as config overrides, non-flag words in `positional`. (options, Config or None); None: --help."""
    if "-h" in argv or "--help" in argv:
        print(command_help(options, about, prog, config, positional))
        return None
    keys = {k.replace("_", "-") if "." not in k else k: k for k in all_keys(options)}
    tree, rest, i = {}, [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            if positional is None:
                raise ConfigError(f"unexpected argument {arg!r}; flags look like --name VALUE (see --help)")
            many = typing.get_origin(_field_type(options, positional)) is list
            tree[positional] = [*tree.get(positional, []), _CliValue(arg)] if many else _CliValue(arg)
            continue
        name, eq, value = arg[2:].partition("=")
        key = keys.get(name) or keys.get(name.replace("_", "-"))
        negated = keys.get(name[3:]) if name.startswith("no-") and not eq else None
        if negated and _field_type(options, negated) is bool:
            _set(tree, negated, _CliValue("false"))
            continue
        if key is None:
            sections = {f.name for f in dataclasses.fields(Config)}
            if not config or name != "config" and name.split(".")[0] not in sections:
                flags = sorted(map(_flag, keys)) + ([f"--{k}" for k in all_keys()] if config else [])
                raise _unknown(f"--{name}", flags, "flag")
            rest.append(arg)  # a training-config override, with its value unless it is a bare boolean flag
            if not eq and i < len(argv) and not argv[i].startswith("--"):
                rest.append(argv[i])
                i += 1
            continue
        tp = _field_type(options, key)
        values, i = _values(argv, i, eq, value, tp, _flag(key))
        _set(tree, key, [_CliValue(v) for v in values] if typing.get_origin(tp) is list else _CliValue(values[0]))
    if positional and positional not in tree and next(
            f for f in dataclasses.fields(options) if f.name == positional).default is dataclasses.MISSING:
        raise ConfigError(f"give the {positional.upper()} argument; see --help")
    choices = typing.get_args(_field_type(options, positional)) if positional else ()
    if positional in tree and typing.get_origin(_field_type(options, positional)) is Literal and \
            tree[positional] not in choices:
        raise ConfigError(f"{tree[positional]!r} is not a {positional}; use one of {', '.join(choices)}")
    return _build(options, tree, "--", lambda: sorted(map(_flag, keys))), load_config(rest) if config else None


def command_help(options: type, about: str, prog: str, config: bool, positional: str | None) -> str:
    many = positional and typing.get_origin(_field_type(options, positional)) is list
    usage = f"usage: python {prog}" + (f" {positional.upper()}{'...' if many else ''}" if positional else "")
    lines = [usage + " [--flag VALUE ...]" + (" [--config FILE] [--section.field VALUE ...]" if config else ""), "",
             about, "", *_field_help(options, "", lambda key, kind: key.upper() if key == positional else
                                     f"{_flag(key)} {kind}", str)]
    if config:
        lines += ["", "Every other --section.field VALUE (and --config FILE) is a training config override; python "
                      "launch/pretrain_gpt.py --help lists them."]
    return "\n".join(lines)


def _field_help(cls, prefix: str, name, show, defaults=None) -> list[str]:
    """Two lines per leaf field of dataclass `cls` (name(key, TYPE); its docstring and default, shown by `show`),
    under a line per nested section. Defaults from the instance `defaults`, else the fields' own."""
    lines = []
    for f in dataclasses.fields(cls):
        tp, key = _hints(cls)[f.name], prefix + f.name
        if defaults is not None:
            value = getattr(defaults, f.name)
        else:
            value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(tp):
            lines += [f"{key}: {f.metadata.get('help', '')}", *_field_help(tp, key + ".", name, show, value), ""]
            continue
        default = "required" if value is dataclasses.MISSING else f"default: {show(value)}"
        lines += [f"  {name(key, '[BOOL]' if tp is bool else _type_name(tp).upper())}",
                  f"      {f.metadata.get('help', '')} ({default})"]
    return lines


def _build_model(values: dict) -> ModelConfig:
    """The model section: start from the preset named by `name`, then apply the other fields."""
    if not isinstance(values, dict):
        raise ConfigError(f"model must be a mapping, got {values!r}")
    hints = _hints(ModelConfig)
    name = _convert("model.name", values.get("name", "tiny"), str)
    overrides = {}
    for key, value in values.items():
        if key == "name":
            continue
        if key not in hints:
            raise _unknown("model." + key, all_keys())
        overrides[key] = _convert("model." + key, value, hints[key])
    if "vocab_size" in overrides:  # a vocabulary given by the user is used as given (and checked against the tokenizer)
        overrides.setdefault("vocab_from_tokenizer", False)
    try:
        return get_model_config(name, **overrides)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = tree.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        tree = node
    tree[leaf] = value


def _values(argv: list[str], i: int, eq: str, value: str, tp, flag: str) -> tuple[list[str], int]:
    """The values of the flag just before argv[i] and the index after them: its =VALUE; true for a bare boolean
    flag; else the next word (for a list, every word up to the next flag)."""
    if eq:
        return [value], i
    if tp is bool and (i == len(argv) or argv[i].startswith("--")):
        return ["true"], i
    values = []
    while i < len(argv) and not argv[i].startswith("--") and (not values or typing.get_origin(tp) is list):
        values.append(argv[i])
        i += 1
    if not values:
        raise ConfigError(f"{flag} needs a value")
    return values, i


def parse_overrides(argv: list[str]) -> tuple[str | None, dict]:
    """Split argv into the --config path and a nested dict of `--a.b VALUE` / `--a.b=VALUE` overrides."""
    keys, config_path, tree, i = set(all_keys()), None, {}, 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; overrides look like --section.field VALUE")
        key, eq, value = arg[2:].partition("=")
        tp = bool if key in keys and _field_type(Config, key) is bool else str  # a config list is one a,b,c word
        (value,), i = _values(argv, i, eq, value, tp, f"--{key}")
        if key == "config":
            config_path = value
        elif key not in keys:
            raise _unknown(key, sorted(keys | {"config"}))
        else:
            _set(tree, key, _CliValue(value))
    return config_path, tree


def _merge(base: dict, top: dict, where: str = "") -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and out.get(k) is not None and not isinstance(out[k], dict):
            raise ConfigError(f"{where}{k}: {out[k]!r} in the --config file is not a mapping of its fields; write "
                              f"'{k}: {{FIELD: VALUE}}' or leave it out")
        out[k] = _merge(out[k], v, f"{where}{k}.") if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader (no Python tags), refusing a key given twice in one mapping (the last one silently won)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_config(argv: list[str]) -> Config:
    """The Config from `--config FILE` and overrides in argv. Raises ConfigError for any user mistake."""
    config_path, overrides = parse_overrides(argv)
    tree: dict = {}
    if config_path is not None:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"--config {config_path}: no such file; the shipped configs are in configs/")
        try:
            tree = yaml.load(path.read_text(encoding="utf-8"), _UniqueKeyLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {config_path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--config {config_path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"--config {config_path} must hold a mapping of sections")
        bad = next((k for k, v in tree.items() if v is not None and not isinstance(v, dict)), None)
        if bad is not None:  # checked before the command line's values merge into it (they would replace it)
            raise ConfigError(f"--config {config_path}: section {bad}: {tree[bad]!r} is not a mapping of its fields; "
                              f"write '{bad}: {{FIELD: VALUE}}' or leave the section out")
    tree = _merge(tree, overrides)
    run = tree.get("run")
    if config_path is not None and (run is None or isinstance(run, dict) and run.get("name") is None):
        # A stable default: the same command (same config file) continues the same run in runs/<name>.
        tree["run"] = {**(run or {}), "name": Path(config_path).stem}
    return config_from_dict(tree)


def config_from_dict(tree: dict) -> Config:
    """Build and validate a Config from a nested dict (as YAML gives it)."""
    sections = {f.name for f in dataclasses.fields(Config)}
    for key in tree:
        if key not in sections:
            raise _unknown(key, sorted(sections))
    section = lambda name: {} if tree.get(name) is None else tree[name]  # noqa: E731  (train: 0 is no section)
    kwargs = {"model": _build_model(section("model"))}
    hints = _hints(Config)
    for name in sections - {"model"}:
        kwargs[name] = _build(hints[name], section(name), name + ".")
    try:
        return Config(**kwargs)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False)


def help_text(prog: str = "launch/pretrain_gpt.py") -> str:
    """Every field with its type, default and docstring, section by section."""
    return "\n".join([f"usage: python {prog} [--config FILE.yaml] [--section.field VALUE ...]", "",
                      "  --config FILE          YAML file of sections (see configs/); command-line values override it",
                      "  -h, --help             show this message", "",
                      *_field_help(Config, "", lambda key, kind: f"--{key} {kind}", repr, Config())])
