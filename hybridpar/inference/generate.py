"""Autoregressive generation with a KV cache, on a model of any layout: one process, tensor parallel (the logits
stay vocab-sharded until the one position each sequence samples from), FSDP (every rank runs the same batch; the
chosen tokens are broadcast from rank 0, so the ranks never disagree on a token or on when to stop).

A batch of prompts is left-padded to the longest (models/kv_cache.py keeps the padding out of attention and out of
the positions), then every step feeds one token per sequence. Under sequence parallelism every call is
right-padded to a multiple of tp. Sampling runs on the CPU from a seeded generator, so a seed gives the same tokens
on every device and layout: greedy (temperature 0), or softmax(logits / temperature) cut to the top_k tokens and
to the smallest set whose probability reaches top_p (Holtzman et al. 2019).

Notation: B prompts, P longest prompt, V vocabulary.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64  # per prompt
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no cut
    top_p: float = 1.0  # 1 = no cut
    seed: int = 0
    stop_at_eod: bool = True  # a sequence ends at its first end-of-document token (kept in its output)

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling settings out of range ({self}): max_new_tokens >= 1, temperature >= 0, "
                             f"top_k >= 0, 0 < top_p <= 1")


@dataclass
class Generated:
    tokens: list[list[int]]  # each prompt's new tokens
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0  # decoding calls after the prefill
    stats: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return sum(map(len, self.tokens))

    @property
    def tokens_per_second(self) -> float:
        """New tokens of all sequences per second, prefill included."""
        return self.new_tokens / max(self.prefill_seconds + self.decode_seconds, 1e-9)


def filtered_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits (B, V) / temperature, with -inf outside the top_k tokens and outside the top_p nucleus."""
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above each one
        drop = before >= s.top_p  # the first token is always kept (before = 0)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> torch.Tensor:
    """The next token of each row of logits (B, V) float32 on the CPU."""
    if s.temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(filtered_logits(logits, s).softmax(-1), 1, generator=gen).squeeze(1)


def _last_logits(logits, columns: torch.Tensor) -> torch.Tensor:
    """logits (B, n, V) -> (B, V) float32 at each row's column, gathered whole when the vocab is sharded."""
    rows = torch.arange(logits.shape[0], device=columns.device)
    if hasattr(logits, "full_tensor"):  # a tensor-parallel LM head's vocab shards: pick, then gather B x V only
        from torch.distributed.tensor import DTensor, Shard

        local = logits.to_local()[rows, columns]  # (B, Vr): ceil(V / tp) rows a rank, fewer on the last if uneven
        whole = (logits.shape[0], logits.shape[-1])
        return DTensor.from_local(local, logits.device_mesh, [Shard(1)], shape=whole,
                                  stride=(whole[1], 1)).full_tensor().float()
    return logits[rows, columns].float()


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], s: Sampling, device: torch.device, eod_id: int | None,
             vocab_limit: int | None = None, pad_multiple: int = 1, autocast=nullcontext,
             on_token: Callable[[int, int], None] | None = None) -> Generated:
    """Each prompt's continuation of up to s.max_new_tokens tokens. vocab_limit: tokens at or past it (the padding
    rows of a vocabulary rounded up for tp) are never chosen. on_token(row, token) hears each new token as it is
    chosen. Raises ValueError when a prompt leaves no room in model.max_seq_len."""
    context = model.cfg.max_seq_len
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(map(len, prompts))
    if P >= context:
        raise ValueError(f"a prompt of {P} tokens leaves no room in the model's context of {context} tokens "
                         f"(model.max_seq_len); shorten it")
    max_new = min(s.max_new_tokens, context - P)
    B, pm = len(prompts), pad_multiple
    width = -(-P // pm) * pm
    cache = model.new_cache(B, width + max_new + pm)
    ids = torch.zeros(B, width, dtype=torch.long)
    valid = torch.zeros(B, width, dtype=torch.bool)
    for b, p in enumerate(prompts):  # left-padded to P, right-padded to a multiple of pm
        ids[b, P - len(p):P], valid[b, P - len(p):P] = torch.tensor(p), True
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    several = dist.is_initialized() and dist.get_world_size() > 1
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(B, dtype=torch.bool)
    was_training = model.training
    model.eval()
    times, t0, steps = [], time.perf_counter(), 0
    column = torch.full((B,), P - 1, device=device)
    try:
        while True:
            with autocast():
                logits = model(ids.to(device), cache=cache, valid=valid.to(device))
            last = _last_logits(logits, column).cpu()  # (B, V)
            if vocab_limit is not None:
                last[:, vocab_limit:] = float("-inf")
            nxt = pick(last, s, gen)
            if several:  # rank 0's choice for every rank
                box = nxt.to(device)
                dist.broadcast(box, src=0)
                nxt = box.cpu()
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    if on_token is not None:
                        on_token(b, int(nxt[b]))
                    done[b] = len(out[b]) >= max_new or (s.stop_at_eod and int(nxt[b]) == eod_id)
            times.append(time.perf_counter() - t0)
            if bool(done.all()):
                break
            steps += 1
            t0 = time.perf_counter()
            ids = torch.zeros(B, pm, dtype=torch.long)
            ids[:, 0] = nxt
            valid = torch.zeros(B, pm, dtype=torch.bool)
            valid[:, 0] = True
            column = torch.zeros(B, dtype=torch.long, device=device)
    finally:
        model.train(was_training)
    return Generated(out, prefill_seconds=times[0], decode_seconds=sum(times[1:]), steps=steps)
