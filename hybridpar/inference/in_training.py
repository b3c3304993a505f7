"""What a run measures of its model besides the training loss: the validation loss, the downstream tasks
(train.eval_tasks) and the end-of-run sample, each on the run's own layout."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext

import torch
from torch.distributed.fsdp import FSDPModule

from hybridpar.inference.evaluate import Scorer, metrics_row, run_task, summary
from hybridpar.inference.generate import Sampling, generate
from hybridpar.training.microbatch import IGNORE_INDEX
from hybridpar.parallel.distributed import local_tensor


class Evaluation:
    """The Trainer's evaluations (its model, mesh, data.valid, tasks, log and stop vote)."""

    @contextmanager
    def _eager(self):
        """Validation and sampling run the compiled blocks eagerly: under no_grad, and with the sample's growing
        lengths, each would compile them again (three compilations of every block instead of one). With float8
        all-gathers the weights' scales are computed first: the last optimizer step changed the weights.

        On the way out every FSDP module is resharded. The root keeps its parameters gathered after a forward (its
        backward follows at once in training); with no backward after an evaluation they would stay gathered, and
        the model's parameters would be those gathered copies, not the shards the optimizer, a checkpoint, a
        rewind's host copy and a restore read and write: outside a step the model is always sharded."""
        if self.fp8_scales is not None:
            self.fp8_scales()
        try:
            with torch.compiler.set_stance("force_eager") if self.cfg.train.compile else nullcontext():
                yield
        finally:
            for m in self.model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Mean token loss over the fixed validation batches, all data-parallel ranks together, as {"val_loss": x},
        with a staged run's per-source losses as "val_loss/<source>"; None when a stop request (a signal on any
        rank) cut it short, between two batches."""
        self.model.eval()
        groups = self.data.valid_sources or {"": self.data.valid}
        total = torch.zeros(len(groups), 2, device=self.device)  # (loss sum, tokens) per source
        with self._eager():
            for g, batches in enumerate(groups.values()):
                for x, y in batches:
                    self.stop_voted = self.stop_voted or bool(self._stop_vote())  # read now: validation stops here
                    if self.stop_voted:
                        break
                    with self.loss_context(), self.autocast():
                        loss = self.forward_loss(self.model, x.to(self.device), y.to(self.device))
                    total[g, 0] += local_tensor(loss)
                    total[g, 1] += (y != IGNORE_INDEX).sum()
        self.model.train()
        total = self._dp_sum(total)
        if self.stop_voted:
            return None
        out = {"val_loss": float(total[:, 0].sum() / total[:, 1].sum())}
        if self.data.valid_sources:
            out.update({f"val_loss/{name}": float(total[g, 0] / total[g, 1]) for g, name in enumerate(groups)})
        return out

    def scorer(self) -> Scorer:
        """A Scorer of this run's model on its layout (train.seq_len windows)."""
        t = self.cfg.train
        return Scorer(self.model, self.mesh, self.device, self.tokenizer, t.seq_len, t.eval_tasks_batch_size,
                      self.autocast, self.tp if self.cfg.parallel.sequence_parallel else 1)

    def _eval_tasks(self) -> None:
        """Score every downstream task (train.eval_tasks) and log one row; a stop request ends it between tasks."""
        results, scorer = {}, self.scorer()
        with self._eager():
            for task in self.tasks:
                self.stop_voted = self.stop_voted or bool(self._stop_vote())
                if self.stop_voted:
                    return self.log.print(f"task evaluation at step {self.step} stopped by a stop request; not logged")
                results[task.name] = run_task(task, scorer)
        self.log.log(metrics_row(self.step, results))
        self.log.print(f"eval step {self.step} | " + " | ".join(summary(n, m) for n, m in results.items()))

    def _validate(self) -> None:
        """Log the validation loss (not when a stop request cut it short)."""
        val = self.evaluate()
        if val is None:
            return self.log.print(f"validation at step {self.step} stopped by a stop request; not logged")
        self.log.log({"step": self.step, **val, "val_ppl": math.exp(min(val["val_loss"], 50.0))})

    def sample(self, prompt: str, n_tokens: int, temperature: float) -> str:
        """The prompt and up to n_tokens sampled after it (hybridpar.inference.generate, the KV-cache generator of
        launch/generate.py), on this run's layout."""
        tok = self.tokenizer
        pad = self.tp if self.cfg.parallel.sequence_parallel else 1  # every call's length divides by tp
        with self._eager():
            out = generate(self.model, [tok.encode(prompt) or [tok.eod_id]],
                           Sampling(n_tokens, temperature, seed=self.cfg.train.seed), self.device, tok.eod_id,
                           vocab_limit=tok.vocab_size, pad_multiple=pad, autocast=self.autocast)
        return prompt + tok.decode(out.tokens[0])
