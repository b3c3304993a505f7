"""The data section of the config (hybridpar.config re-exports it): what the run trains on, its split and caches,
batches never to train, and data stages."""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

from hybridpar.models.config import doc


@dataclass(frozen=True)
class DataConfig:
    path: str = doc("builtin", "'builtin' (Python's own documentation), a Megatron .bin/.idx prefix, or a weighted "
                               "blend 'W1 PREFIX1 W2 PREFIX2 ...' (see docs/data.md)")
    tokenizer: str = doc("train-bpe:4096", "the data's tokenizer: bytes, bpe:PATH (tokenizer.json), gpt2:DIR, "
                                           "sentencepiece:MODEL, or train-bpe:N (an N-token BPE trained on the builtin corpus)")
    split: str = doc("95,5,0", "train,valid,test weights, by document (each prefix of a blend is split alike)")
    cache_dir: str = doc("~/.cache/hybridpar", "built corpus, tokenizers and dataset index caches; shared by all "
                                               "nodes of a multi-node run")
    skip_batches: list[str] = doc([], "global batches never to train, as ranges A-B of batch numbers (batch N is the "
                                      "one step N trains when nothing is skipped; comma-separated on the command "
                                      "line), added to those a checkpoint's rewinds skipped")
    stages: list[str] = doc([], "a mixture that changes during the run: entries 'START[ ramp R][ seq L]: BLEND' "
                                "(START, R in global batches, or samples with an 's' suffix; L tokens per sequence; "
                                "BLEND as data.path), the first at 0; replaces data.path (docs/data.md#stages)")
    source_exhausted: Literal["wrap", "stop"] = doc("wrap", "a source (of data.path or a stage) read past one pass over its train split: wrap (its next "
                                        "pass, reshuffled) or stop (refused at start, naming the source)")

    def __post_init__(self):
        parts = self.split.split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            weights = []
        if not self.path.strip():
            raise ValueError("data.path='' names no data; give 'builtin', a .bin/.idx prefix or a blend")
        if len(weights) != 3 or not all(map(math.isfinite, weights)) or min(weights) < 0 or weights[0] <= 0 \
                or weights[1] <= 0:
            raise ValueError(f"data.split={self.split!r}: give three weights train,valid,test with train and valid > 0, e.g. 98,1,1")
        self.skip_windows  # parsed (and checked) once here
        check_choices("data", self)
        if self.stages and self.path != "builtin":
            raise ValueError(f"data.path={self.path!r} and data.stages both name the training data; put every source "
                             f"in data.stages (e.g. '0: 1 {self.path.split()[-1]}') and drop data.path")

    @cached_property  # (kept in the instance's __dict__, beside the frozen fields: parsed once)
    def skip_windows(self) -> list[tuple[int, int]]:
        """data.skip_batches as sorted, merged (first, last) batch numbers, 1-based and inclusive."""
        windows = []
        for text in self.skip_batches:
            a, sep, b = str(text).partition("-")
            if not (a.strip().isdigit() and (not sep or b.strip().isdigit())):
                raise ValueError(f"data.skip_batches={text!r}: give ranges of batch numbers A-B (or N), e.g. 101-120")
            first, last = int(a), int(b) if sep else int(a)
            if not 1 <= first <= last:
                raise ValueError(f"data.skip_batches={text!r}: a range A-B needs 1 <= A <= B")
            windows.append((first, last))
        return merge_windows(windows)

    @property
    def cache_path(self) -> Path:
        return Path(os.path.expanduser(self.cache_dir))

    @cached_property
    def split_fractions(self) -> tuple[float, float, float]:
        w = [float(p) for p in self.split.split(",")]
        return w[0] / sum(w), w[1] / sum(w), w[2] / sum(w)


def check_choices(section: str, config) -> None:
    """Every field of a config section typed Literal[...] (or Optional of one) holds one of the choices its type
    names: the choices are written once, in the type (the command-line parser reads the same type)."""
    for name, tp in typing.get_type_hints(type(config)).items():
        args = typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,)
        if not all(a is type(None) or typing.get_origin(a) is Literal for a in args):
            continue  # (a Literal beside other types, e.g. a name or a number: the field checks itself)
        choices = [c for a in args if a is not type(None) for c in typing.get_args(a)]
        value = getattr(config, name)
        if value not in choices and not (value is None and type(None) in args):
            names = [str(c) for c in choices]
            raise ValueError(f"{section}.{name}={value!r}: use {', '.join(names[:-1])} or {names[-1]}")


def merge_windows(windows) -> list[tuple[int, int]]:
    """Inclusive (first, last) ranges, sorted and with overlapping or touching ones joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
