"""lm-evaluation-harness's model type `hybridpar`: any harness task on a hybridpar checkpoint, no conversion.

    python launch/harness.py --model hybridpar --model_args checkpoint=runs/x --tasks hellaswag
    torchrun --nproc_per_node 2 launch/harness.py --model hybridpar --model_args checkpoint=runs/x,tp=2 --tasks ...

Importing this module registers the type (lm-eval 0.4 finds model types only by registration at import; it has no
plugin entry point, so launch/harness.py imports it and then runs lm-eval's own command line). The three request
kinds are answered by hybridpar's Scorer and generator on the sharded model: loglikelihood, loglikelihood_rolling
(windows of max_length tokens that predict every token once) and generate_until (greedy unless the task asks to
sample; cut at the first stop string). Every rank runs every request together (tensor parallel and FSDP ranks
compute one model); the Scorer itself spreads batches over the data-parallel ranks. So every rank tells lm-eval it
is rank 0 of a world of 1: lm-eval then gives each rank the same requests (were a rank to report its own rank, lm-eval
would hand it another slice of the documents, and the ranks' collectives would not match). launch/harness.py lets
only global rank 0 print and write results.
"""

from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from hybridpar.config.cli import load_config
from hybridpar.errors import ConfigError
from hybridpar.inference.evaluate import Scorer
from hybridpar.inference.generate import Sampling, generate
from hybridpar.inference.load import load_for_inference


MODEL_ARGS = ("checkpoint", "max_length", "tokenizer", "dp_replicate", "dp_shard", "tp", "sequence_parallel",
              "precision")


def _positive(name: str, value, allow_auto: bool = False) -> int:
    """model_args / --batch_size value as a positive int ('auto' allowed where lm-eval offers it), or ConfigError."""
    try:
        number = int(value) if float(value) == int(float(value)) else 0  # lm-eval parses '5' as 5, '-5' as -5.0
    except (TypeError, ValueError, OverflowError):
        number = 0
    if number < 1:
        raise ConfigError(f"{name}={value!r} must be a positive whole number" + (" or auto" if allow_auto else ""))
    return number


@register_model("hybridpar")
class HybridparLM(LM):
    def __init__(self, checkpoint: str | None = None, batch_size: int | str = 16, max_length: int | None = None,
                 tokenizer: str | None = None, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1,
                 sequence_parallel: bool = False, precision: str | None = None, device: str | None = "auto",
                 max_batch_size: int | None = None, **unknown):
        """checkpoint: a run dir, checkpoint dir or export; max_length: the scoring window (default the
        checkpoint's train.seq_len); the layout and numerics as the training config names them. batch_size,
        max_batch_size and device come from lm-eval's own options."""
        if unknown:
            raise ConfigError(f"--model_args {sorted(unknown)[0]}=... is not an argument of the hybridpar model; "
                              f"use {', '.join(MODEL_ARGS)}")
        if not checkpoint:
            raise ConfigError("--model_args needs checkpoint=PATH (a run dir, checkpoint dir or export)")
        batch = 16 if str(batch_size).startswith("auto") else _positive("--batch_size", batch_size, True)
        if max_length is not None:
            _positive("--model_args max_length", max_length)
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
        self.scorer = Scorer(self.loaded.model, self.loaded.mesh, run.device, self.loaded.tokenizer, self.max_length,
                             batch, self.loaded.autocast, self.pad)
        self._rank, self._world_size = 0, 1  # on every rank: see the module docstring

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
