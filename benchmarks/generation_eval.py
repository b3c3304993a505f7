"""Generation tokens/s (KV cache against recomputing the whole sequence per token) and downstream-task evaluation
time, on one process, for a trained checkpoint (the default run's, e.g.).

    python benchmarks/generation_eval.py runs/tiny
    python benchmarks/generation_eval.py runs/x --new-tokens 256 --train.device cuda

Prints one JSON object: per case the new tokens, seconds and tokens/s (best of --repeats), and the evaluation's
examples and seconds.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import torch

from hybridpar.config.cli import parse_command
from hybridpar.models.config import doc


@dataclass(frozen=True)
class Options:
    checkpoint: list[str] = field(default_factory=list, metadata={"help": "a run dir, checkpoint dir or export"})
    new_tokens: int = doc(128, "new tokens per sequence")
    batch: int = doc(8, "sequences of the batched case")
    repeats: int = doc(3, "runs of each case; the best is reported")
    tasks: list[str] = doc(["builtin:next-words"], "tasks whose evaluation is timed")
    eval_batch_size: int = doc(16, "sequences per forward when scoring")


@torch.no_grad()
def recompute_tokens_per_second(model, prompt: list[int], n: int, device, autocast) -> float:
    """Greedy decoding without a cache: the whole sequence through the model for every new token."""
    ids = list(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        with autocast():
            logits = model(torch.tensor([ids], device=device))
        ids.append(int(logits[0, -1].float().argmax()))
    return n / (time.perf_counter() - t0)


def main(argv: list[str]) -> dict:
    from hybridpar.inference.evaluate import Scorer, run_task
    from hybridpar.inference.generate import Sampling, generate
    from hybridpar.inference.load import load_for_inference
    from hybridpar.inference.tasks import load_tasks
    from hybridpar.parallel.distributed import shutdown

    parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "benchmarks/generation_eval.py", config=True,
                           positional="checkpoint")
    if parsed is None:
        return {}
    a, cfg = parsed
    try:
        loaded = load_for_inference(a.checkpoint[0], cfg)
        model, tok, run = loaded.model, loaded.tokenizer, loaded.run
        dev, prompt = run.device, tok.encode("Return the number of")
        room = run.cfg.model.max_seq_len - len(prompt)
        s = Sampling(max_new_tokens=min(a.new_tokens, room), stop_at_eod=False)
        out = {"checkpoint": str(loaded.source.path), "device": str(dev), "precision": run.cfg.train.precision,
               "threads": torch.get_num_threads(), "prompt_tokens": len(prompt), "new_tokens": s.max_new_tokens}
        for name, prompts in (("one", [prompt]), (f"batch{a.batch}", [prompt] * a.batch)):
            best = max((generate(model, prompts, s, dev, tok.eod_id, autocast=loaded.autocast)
                        for _ in range(a.repeats)), key=lambda g: g.tokens_per_second)
            out[f"kv_cache_{name}"] = {"tokens_per_s": best.tokens_per_second, "prefill_s": best.prefill_seconds,
                                       "decode_ms_per_step": 1e3 * best.decode_seconds / max(best.steps, 1)}
        out["recompute_one_tokens_per_s"] = max(recompute_tokens_per_second(model, prompt, s.max_new_tokens, dev,
                                                                            loaded.autocast)
                                                for _ in range(a.repeats))
        scorer = Scorer(model, loaded.mesh, dev, tok, run.cfg.train.seq_len, a.eval_batch_size, loaded.autocast)
        for task in load_tasks(a.tasks, cfg.data):
            times = []
            for _ in range(a.repeats):
                m = run_task(task, scorer)
                times.append(m["seconds"])
            out[f"eval_{task.name}"] = {"examples": m["examples"], "seconds": min(times),
                                        **{k: v for k, v in m.items() if k not in ("examples", "seconds")}}
        return out
    finally:
        loaded = model = None
        shutdown()


if __name__ == "__main__":
    result = main(sys.argv[1:])
    if result:
        print(json.dumps(result, indent=1))
