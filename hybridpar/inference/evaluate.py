"""Log-likelihood scoring on the sharded model, and the metrics of each task kind (hybridpar/inference/tasks.py).

Scorer.loglikelihood is the one primitive: the log-probability of a continuation's tokens after a context, and
whether greedy decoding would produce them. Requests are sorted by length and cut into batches of a fixed size,
each right-padded to a multiple of 16 tokens; batch k runs on data-parallel rank k mod dp (the ranks of a tensor-
parallel group run it together), so every request is computed in the same batch, with the same padding, on every
layout. Under tensor parallelism the logits stay vocab-sharded: each rank takes the max, the sum of exponentials
and the target's logit over its vocabulary slice and three all-reduces over the tp group finish the log-softmax
(Megatron-LM's vocab-parallel cross entropy, Shoeybi et al. 2019), so no rank holds B x T x V.

Conventions follow lm-evaluation-harness, so its tasks and hybridpar's agree: trailing spaces of a context move to
the continuation, an empty context is the end-of-document token, a context is cut from the left to fit the
window, acc_norm divides each choice's log-likelihood by its length in characters, perplexity documents are
scored in windows that predict every token once with as much context as the window holds.

Notation: B batch, T padded length, V vocabulary (V / tp on a rank).
"""

from __future__ import annotations

import math
import re
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.inference.tasks import Task
from hybridpar.parallel.distributed import dp_rank_size, dp_sum, local_tensor
from hybridpar.parallel.context import chunk_positions

PAD_TO = 16  # batch lengths are rounded up to this, the same on every layout


def vocab_parallel_logprobs(logits, targets: torch.Tensor, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), target is the argmax) per position, from logits (B, T, V) (a DTensor sharded over the vocab
    under tp, its local slice used) and targets (B, T) (entries < 0 give 0 and False). A vocabulary tp does not
    divide is split as torch.chunk splits it: ceil(V / tp) rows a rank, the last ranks fewer (or none)."""
    local = local_tensor(logits).float()  # (B, T, Vr)
    several = tp_group is not None and dist.get_world_size(tp_group) > 1
    start = dist.get_rank(tp_group) * -(-logits.shape[-1] // dist.get_world_size(tp_group)) if several else 0
    top = local.max(-1).values  # (B, T)
    if several:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp = (local - top[..., None]).exp().sum(-1)
    mine = (targets >= start) & (targets < start + local.shape[-1])
    picked = local.gather(-1, (targets - start).clamp(0, local.shape[-1] - 1)[..., None]).squeeze(-1)
    picked = torch.where(mine, picked, 0.0)
    if several:
        dist.all_reduce(sum_exp, group=tp_group)
        dist.all_reduce(picked, group=tp_group)
    logprob = picked - top - sum_exp.log()
    valid = targets >= 0
    return torch.where(valid, logprob, 0.0), valid & (picked >= top)


PROGRESS_S = 10.0  # a long scoring says how far it is this often


class Scorer:
    def __init__(self, model: nn.Module, mesh, device: torch.device, tokenizer, max_len: int, batch_size: int = 16,
                 autocast=nullcontext, pad_multiple: int = 1, progress=None):
        """Scores with `model` (parallelised over `mesh`) in windows of max_len tokens, batch_size sequences a
        forward. pad_multiple: sequence parallelism's tp (every length divides by it). progress(done, total):
        called with the forwards done of a request list's total every PROGRESS_S seconds of a long one."""
        self.model, self.mesh, self.device, self.tok, self.progress = model, mesh, device, tokenizer, progress
        self.max_len, self.batch_size, self.autocast, self.pad_multiple = max_len, batch_size, autocast, pad_multiple
        self.dp_rank, self.dp = dp_rank_size(mesh)
        self.dp_sum = dp_sum(mesh)
        self.tp_group = mesh["tp"].get_group() if mesh["tp"].size() > 1 else None
        # context parallelism: each cp rank scores its two chunks of every window (hybridpar.parallel.context)
        self.cp, self.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()

    # -- text -> tokens, as lm-evaluation-harness splits them ------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.tok.eod_id], self.tok.encode(continuation)
        whole, ctx = self.tok.encode(context + continuation), self.tok.encode(context)
        return ctx, whole[len(ctx):]

    def rolling_pairs(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """(context, continuation) windows predicting every token of a document once: the first after the
        end-of-document token, each next one after the max_len tokens before its end."""
        seq = [self.tok.eod_id] + tokens
        return [(seq[:a + 1], tokens[a:a + self.max_len]) for a in range(0, len(tokens), self.max_len)]

    def rolling_loglikelihood(self, docs: list[list[int]]) -> list[float]:
        """Each document's summed log-likelihood, every token predicted once (rolling_pairs)."""
        pairs = [self.rolling_pairs(d) for d in docs]
        flat = [v for v, _ in self.loglikelihood([p for doc in pairs for p in doc])]
        out, at = [], 0
        for doc in pairs:
            out.append(sum(flat[at:at + len(doc)]))
            at += len(doc)
        return out

    # -- the primitive ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def loglikelihood(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Each (context, continuation)'s summed log-probability and greedy flag, the same list on every rank."""
        if any(not cont or len(cont) > self.max_len or not ctx for ctx, cont in pairs):
            raise ValueError("every request needs a context and a continuation of 1 to max_len tokens")
        seqs = [(ctx + cont)[-(self.max_len + 1):] for ctx, cont in pairs]
        order = sorted(range(len(pairs)), key=lambda i: (-len(seqs[i]), i))
        batches = [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]
        results = torch.zeros(len(pairs), 2, dtype=torch.float64, device=self.device)
        was_training = self.model.training
        self.model.eval()
        rounds, shown = -(-len(batches) // self.dp), time.perf_counter()
        try:
            for r in range(rounds):  # every rank the same number of forwards (FSDP)
                if self.progress is not None and time.perf_counter() - shown > PROGRESS_S:
                    self.progress(r, rounds)
                    shown = time.perf_counter()
                k = r * self.dp + self.dp_rank
                mine = batches[k] if k < len(batches) else batches[0][:1]  # a spare rank repeats a request, unused
                ll, missed = self._score(mine, seqs, pairs)
                if k < len(batches):
                    results[mine, 0], results[mine, 1] = ll, missed
        finally:
            self.model.train(was_training)
        # each request was scored on one data-parallel rank, its tokens split over its cp ranks: the sums are its
        # log-likelihood and its count of tokens that were not the argmax
        self.dp_sum(results)
        return [(float(a), b == 0) for a, b in results.tolist()]

    def _score(self, rows: list[int], seqs, pairs) -> tuple[torch.Tensor, torch.Tensor]:
        longest = max(len(seqs[i]) - 1 for i in rows)
        # (sequence parallelism: a multiple of tp as well; context parallelism: of 2 cp, and of cp x tp with both)
        multiple = math.lcm(self.pad_multiple * self.cp, 2 * self.cp)
        step = math.lcm(PAD_TO, multiple)
        T = -(-longest // step) * step
        if T > self.model.cfg.max_seq_len:  # max_len (<= the context, = train.seq_len) divides by `multiple`
            T = -(-longest // multiple) * multiple
        x = torch.zeros(len(rows), T, dtype=torch.long)
        y = torch.full((len(rows), T), -1, dtype=torch.long)
        for b, i in enumerate(rows):
            s, n_cont = seqs[i], len(pairs[i][1])
            x[b, :len(s) - 1] = torch.tensor(s[:-1])
            y[b, len(s) - 1 - n_cont:len(s) - 1] = torch.tensor(s[-n_cont:])
        x, y = x.to(self.device), y.to(self.device)
        kw = {}
        if self.cp > 1:  # this rank's chunks of each window, at their positions
            kw["positions"] = chunk_positions(T, self.cp, self.cp_rank, self.device)
            x, y = x[:, kw["positions"]], y[:, kw["positions"]]
        with self.autocast():
            logits = self.model(x, **kw)  # (B, T / cp, V)
        logprob, is_max = vocab_parallel_logprobs(logits, y, self.tp_group)
        scored = y >= 0
        return logprob.double().sum(1), (~is_max & scored).sum(1).double()


def run_task(task: Task, scorer: Scorer) -> dict[str, float]:
    """The task's metrics (the same on every rank): multiple choice acc and acc_norm, cloze acc and ppl (exp of
    minus the mean log-likelihood of a target), perplexity token/word/byte perplexity and bits per byte."""
    t0 = time.perf_counter()
    ex = task.examples
    if task.kind == "multiple_choice":
        pairs = [scorer.encode_pair(e["context"], c) for e in ex for c in e["choices"]]
        ll = [v for v, _ in scorer.loglikelihood(pairs)]
        acc = acc_norm = 0
        at = 0
        for e in ex:
            mine = ll[at:at + len(e["choices"])]
            at += len(e["choices"])
            norm = [v / len(c) for v, c in zip(mine, e["choices"])]
            acc += _argmax(mine) == e["label"]
            acc_norm += _argmax(norm) == e["label"]
        out = {"acc": acc / len(ex), "acc_norm": acc_norm / len(ex), "chance": sum(1 / len(e["choices"]) for e in ex)
               / len(ex)}
    elif task.kind == "cloze":
        res = scorer.loglikelihood([scorer.encode_pair(e["context"], e["target"]) for e in ex])
        out = {"acc": sum(g for _, g in res) / len(ex), "ppl": math.exp(-sum(v for v, _ in res) / len(ex))}
    else:
        docs = [scorer.tok.encode(e["text"]) for e in ex]
        total = sum(scorer.rolling_loglikelihood(docs))
        n_tokens = sum(map(len, docs))
        words = sum(len(re.split(r"\s+", e["text"])) for e in ex)
        n_bytes = sum(len(e["text"].encode("utf-8")) for e in ex)
        out = {"token_perplexity": math.exp(-total / n_tokens), "word_perplexity": math.exp(-total / words),
               "byte_perplexity": math.exp(-total / n_bytes), "bits_per_byte": -total / n_bytes / math.log(2)}
    out["examples"] = len(ex)
    out["seconds"] = time.perf_counter() - t0
    return out


def summary(name: str, metrics: dict[str, float]) -> str:
    """One task's console text: `next-words acc 0.31 acc_norm 0.35 chance 0.25 (400 examples, 5.3s)`."""
    shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k not in ("examples", "seconds"))
    return f"{name} {shown} ({metrics['examples']} examples, {metrics['seconds']:.1f}s)"


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first of equal maxima, as numpy's


def metrics_row(step: int, results: dict[str, dict[str, float]]) -> dict:
    """{"step": step, "eval/<task>/<metric>": value, ...} for metrics.jsonl and W&B."""
    row = {"step": step}
    for name, metrics in results.items():
        row.update({f"eval/{name}/{k}": v for k, v in metrics.items()})
    return row
