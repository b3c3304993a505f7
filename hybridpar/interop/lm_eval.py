"""lm-evaluation-harness's model type `hybridpar`: any harness task on a hybridpar checkpoint, no conversion.

    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --tasks hellaswag
    torchrun --nproc_per_node 2 launch/harness.py --model hybridpar --model_args checkpoint=runs/x,tp=2 --tasks ...

Importing this module registers the type (lm-eval 0.4 finds model types only by registration at import; it has no
plugin entry point, so launch/harness.py imports it and then runs lm-eval's own command line). The three request
kinds are answered by hybridpar's Scorer and generator on the sharded model: loglikelihood, loglikelihood_rolling
(windows of max_length tokens that predict every token once) and generate_until (greedy unless the task asks to
sample; cut at the first stop string). Every rank runs every request together (tensor parallel and FSDP ranks
compute one model); the Scorer itself spreads batches over the data-parallel ranks. lm-eval is told world size 1
so it does not split the requests by rank, and only rank 0 reports.
"""

from __future__ import annotations

import torch.distributed as dist
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from hybridpar.config.cli import load_config
from hybridpar.inference.evaluate import Scorer
from hybridpar.inference.generate import Sampling, generate
from hybridpar.inference.load import load_for_inference


@register_model("hybridpar")
class HybridparLM(LM):
    def __init__(self, checkpoint: str, batch_size: int | str = 16, max_length: int | None = None,
                 tokenizer: str | None = None, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                 sequence_parallel: bool = False, precision: str | None = None, device: str | None = "auto",
                 **_ignored):
        """checkpoint: a run dir, checkpoint dir or export; max_length: the scoring window (default the
        checkpoint's train.seq_len); the layout and numerics as the training config names them."""
        super().__init__()
        device = str(device or "auto")
        if device.startswith("cuda"):  # lm-eval's --device (default cuda:0); a rank takes its local GPU anyway
            import torch

            if not torch.cuda.is_available():
                print(f"note: lm-eval's device {device}, but no CUDA device is visible: running on the CPU",
                      flush=True)
            device = "cuda" if torch.cuda.is_available() else "cpu"
        argv = ["--parallel.dp_replicate", str(dp_replicate), "--parallel.dp_shard", str(dp_shard),
                "--parallel.tp", str(tp), "--parallel.sequence_parallel", str(sequence_parallel).lower(),
                "--train.device", device] + (["--train.precision", precision] if precision else [])
        self.loaded = load_for_inference(checkpoint, load_config(argv), tokenizer)
        run = self.loaded.run
        self.pad = run.layout.tp if run.cfg.parallel.sequence_parallel else 1
        self.max_length = int(max_length or run.cfg.train.seq_len)
        batch = 16 if str(batch_size).startswith("auto") else int(batch_size)
        self.scorer = Scorer(self.loaded.model, self.loaded.mesh, run.device, self.loaded.tokenizer, self.max_length,
                             batch, self.loaded.autocast, self.pad)
        self._rank, self._world_size = dist.get_rank(), 1  # see the module docstring

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.source.path)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self.scorer.loglikelihood([self.scorer.encode_pair(*r.args[:2]) for r in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return self.scorer.rolling_loglikelihood([self.loaded.tokenizer.encode(r.args[0]) for r in requests])

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        tok, run = self.loaded.tokenizer, self.loaded.run
        out = []
        for r in requests:  # one at a time: each request has its own stop strings and length
            context, kwargs = r.args[0], dict(r.args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(kwargs.get("max_gen_toks", 256))
            ids = (tok.encode(context) or [tok.eod_id])[-max(1, self.max_length - new):]
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            s = Sampling(max(1, min(new, self.max_length - len(ids))), temperature, seed=0)
            got = generate(self.loaded.model, [ids], s, run.device, tok.eod_id, vocab_limit=tok.vocab_size,
                           pad_multiple=self.pad, autocast=self.loaded.autocast)
            text = tok.decode(got.tokens[0])
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            out.append(text)
        return out
