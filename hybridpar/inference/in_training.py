"""What a run measures of its model besides the training loss: the validation loss, the downstream tasks
(train.eval_tasks) and the end-of-run sample, each on the run's own layout. The Evaluator is given what it reads and
returns numbers; the trainer logs them."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.fsdp import FSDPModule

from hybridpar.inference.evaluate import Scorer, metrics_row, run_task, summary
from hybridpar.inference.generate import Sampling, generate
from hybridpar.training.microbatch import IGNORE_INDEX
from hybridpar.parallel.distributed import local_tensor


class Evaluator:
    """Evaluations of a training run's model. `numerics` is the trainer's (autocast, loss, fp8 scales: what a training
    forward uses); `stop_vote()` is the collective stop test, called between two batches or tasks (True: stop)."""

    def __init__(self, cfg, model, mesh, device, tokenizer, numerics, data, tasks, dp_sum, stop_vote):
        self.cfg, self.model, self.mesh, self.device, self.tokenizer = cfg, model, mesh, device, tokenizer
        self.numerics, self.data, self.tasks, self.dp_sum, self.stop_vote = numerics, data, tasks, dp_sum, stop_vote

    def _pad(self) -> int:
        """What every sequence length must divide by: tp under sequence parallelism."""
        return self.mesh["tp"].size() if self.cfg.parallel.sequence_parallel else 1

    @contextmanager
    def _eager(self):
        """Validation and sampling run the compiled blocks eagerly: under no_grad, and with the sample's growing
        lengths, each would compile them again (three compilations of every block instead of one). With float8
        all-gathers the weights' scales are computed first: the last optimizer step changed the weights.

        On the way out every FSDP module is resharded. The root keeps its parameters gathered after a forward (its
        backward follows at once in training); with no backward after an evaluation they would stay gathered, and
        the model's parameters would be those gathered copies, not the shards the optimizer, a checkpoint, a
        rewind's host copy and a restore read and write: outside a step the model is always sharded."""
        if self.numerics.fp8_scales is not None:
            self.numerics.fp8_scales()
        try:
            with torch.compiler.set_stance("force_eager") if self.cfg.train.compile else nullcontext():
                yield
        finally:
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    @torch.no_grad()
    def validation(self) -> dict[str, float] | None:
        """Mean token loss over the fixed validation batches, all data-parallel ranks together, as {"val_loss": x},
        with a staged run's per-source losses as "val_loss/<source>"; None when a stop request (a signal on any
        rank) cut it short, between two batches."""
        self.model.eval()
        groups = self.data.valid_sources or {"": self.data.valid}
        total = torch.zeros(len(groups), 2, device=self.device)  # (loss sum, tokens) per source
        n = self.numerics
        stopped = False
        with self._eager():
            for g, batches in enumerate(groups.values()):
                for x, y in batches:
                    stopped = stopped or self.stop_vote()
                    if stopped:
                        break
                    with n.loss_context(), n.autocast():
                        loss = n.forward_loss(self.model, x.to(self.device), y.to(self.device))
                    total[g, 0] += local_tensor(loss)
                    total[g, 1] += (n.mine(y) != IGNORE_INDEX).sum()
        self.model.train()
        total = self.dp_sum(total)
        if stopped:
            return None
        out = {"val_loss": float(total[:, 0].sum() / total[:, 1].sum())}
        if self.data.valid_sources:
            out.update({f"val_loss/{name}": float(total[g, 0] / total[g, 1]) for g, name in enumerate(groups)})
        return out

    def validate_at(self, step: int, log, say) -> None:
        """The validation loss, logged as step `step`'s row (not when a stop request cut it short)."""
        val = self.validation()
        if val is None:
            return say(f"validation at step {step} stopped by a stop request; not logged")
        log({"step": step, **val, "val_ppl": math.exp(min(val["val_loss"], 50.0))})

    def tasks_at(self, step: int, log, say) -> None:
        """Every downstream task scored, logged as one row of step `step`; a stop request ends it between tasks."""
        results = self.run_tasks()
        if results is None:
            return say(f"task evaluation at step {step} stopped by a stop request; not logged")
        log(metrics_row(step, results))
        say(f"eval step {step} | " + " | ".join(summary(n, m) for n, m in results.items()))

    def scorer(self) -> Scorer:
        """A Scorer of this run's model on its layout (train.seq_len windows)."""
        t = self.cfg.train
        return Scorer(self.model, self.mesh, self.device, self.tokenizer, t.seq_len, t.eval_tasks_batch_size,
                      self.numerics.autocast, self._pad())

    def run_tasks(self) -> dict | None:
        """Every downstream task's (train.eval_tasks) metrics by name; None when a stop request ended it between
        tasks."""
        results, scorer = {}, self.scorer()
        with self._eager():
            for task in self.tasks:
                if self.stop_vote():
                    return None
                results[task.name] = run_task(task, scorer)
        return results

    def sample(self, prompt: str, n_tokens: int, temperature: float) -> str:
        """The prompt and up to n_tokens sampled after it (hybridpar.inference.generate, the KV-cache generator of
        launch/generate.py), on this run's layout."""
        tok = self.tokenizer
        pad = self._pad()
        with self._eager():
            out = generate(self.model, [tok.encode(prompt) or [tok.eod_id]],
                           Sampling(n_tokens, temperature, seed=self.cfg.train.seed), self.device, tok.eod_id,
                           vocab_limit=tok.vocab_size, pad_multiple=pad, autocast=self.numerics.autocast)
        return prompt + tok.decode(out.tokens[0])
