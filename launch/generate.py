"""Generate text from a hybridpar checkpoint, on one process or any layout under torchrun.

    python launch/generate.py runs/default "def fibonacci(n):" --max-new-tokens 64
    python launch/generate.py runs/x/checkpoints/step_00001000 --prompts-file prompts.txt --temperature 0.8 --top-p 0.95
    torchrun --nproc_per_node 2 launch/generate.py runs/x "The " --parallel.tp 2

CHECKPOINT is a run dir (its latest checkpoint), a checkpoint dir of any layout, a from-hf / from-megatron output
or a to-torch export. Prompts come as arguments or from a file (one prompt per line). One prompt streams to the
terminal as it is generated; a batch prints each prompt's text when done. --parallel.* and --train.precision /
--train.device set this command's layout and numerics; the model is the checkpoint's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from hybridpar.config.cli import parse_command
from hybridpar.errors import ConfigError, UserError
from hybridpar.models.config import doc


MAX_PROMPTS_BYTES = 64 * 2**20  # prompts and their continuations are held in memory


@dataclass(frozen=True)
class Options:
    checkpoint: Optional[str] = doc(None, "a run dir, checkpoint dir or export (default: the first argument)")
    prompts: list[str] = field(default_factory=list, metadata={"help": "prompts (each a separate argument)"})
    prompts_file: Optional[str] = doc(None, "a text file of prompts, one per line (blank lines skipped)")
    max_new_tokens: int = doc(64, "new tokens per prompt at most (fewer where the context ends)")
    temperature: float = doc(0.0, "0 = greedy; else sample from softmax(logits / temperature)")
    top_k: int = doc(0, "sample among the k most likely tokens only; 0 = all")
    top_p: float = doc(1.0, "sample among the smallest set of tokens whose probability reaches p; 1 = all")
    seed: int = doc(0, "seed of the sampling")
    stop_at_eod: bool = doc(True, "end a sequence at its end-of-document token (--no-stop-at-eod runs to the length)")
    batch_size: int = doc(16, "prompts generated together")
    tokenizer: Optional[str] = doc(None, "tokenizer spec when the checkpoint holds none (bytes, bpe:PATH, ...)")


def parse(argv: list[str]):
    parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/generate.py", config=True,
                           positional="prompts")
    if parsed is None:
        return None
    a, cfg = parsed
    if any(arg.startswith("--model.") for arg in argv):
        raise ConfigError("the model is the checkpoint's: drop the --model.* flags")
    if a.checkpoint is None:
        if not a.prompts:
            raise ConfigError("give the CHECKPOINT (a run dir, checkpoint dir or export) and a prompt; see --help")
        a = replace(a, checkpoint=a.prompts[0], prompts=a.prompts[1:])
    prompts = list(a.prompts)
    if not 0 <= a.seed < 2**63:
        raise ConfigError(f"--seed {a.seed} must be in [0, 2**63) (a torch generator's seed)")
    if a.prompts_file:
        path = Path(a.prompts_file)
        if path.exists() and not path.is_file():
            raise ConfigError(f"--prompts-file {a.prompts_file!r} is not a regular file; give a text file with one "
                              f"prompt per line")
        size = path.stat().st_size if path.is_file() else 0
        if size > MAX_PROMPTS_BYTES:
            raise ConfigError(f"--prompts-file {a.prompts_file!r} holds {size:,} bytes, over {MAX_PROMPTS_BYTES:,}: "
                              f"generation keeps every prompt and its output in memory; split the file")
        try:
            prompts += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompts-file {a.prompts_file!r} cannot be read as UTF-8 text ({e}); give a text "
                              f"file with one prompt per line") from None
    if not prompts:
        raise ConfigError("no prompt: give one as an argument or --prompts-file FILE")
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size} must be >= 1")
    return a, cfg, prompts


def main(a, cfg, prompts: list[str]) -> None:
    import torch.distributed as dist

    from hybridpar.inference.generate import Sampling, generate
    from hybridpar.inference.load import load_for_inference
    from hybridpar.parallel.distributed import shutdown

    try:
        s = Sampling(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed, a.stop_at_eod)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        loaded = load_for_inference(a.checkpoint, cfg, a.tokenizer)
        model, tok, run = loaded.model, loaded.tokenizer, loaded.run
        rank0 = dist.get_rank() == 0
        context = run.cfg.model.max_seq_len
        encoded = [tok.encode(p) for p in prompts]
        for i, ids in enumerate(encoded):
            if not ids or len(ids) >= context:
                raise ConfigError(f"prompt {i + 1} is {len(ids)} tokens; it must hold 1 to {context - 1} tokens to "
                                  f"leave room in the model's context of {context} (model.max_seq_len)")
        if rank0:
            print(f"model {run.cfg.model.name} from {loaded.source.path} | mesh "
                  f"{dict(zip(loaded.mesh.mesh_dim_names, loaded.mesh.shape))} | {run.device} "
                  f"({run.cfg.train.precision})", file=sys.stderr, flush=True)
        stream = len(prompts) == 1 and rank0
        total_tokens, total_seconds = 0, 0.0
        for start in range(0, len(prompts), a.batch_size):
            batch = encoded[start:start + a.batch_size]
            printer = _Streamer(tok, prompts[0]) if stream else None
            out = generate(model, batch, s, run.device, tok.eod_id, vocab_limit=tok.vocab_size,
                           pad_multiple=run.layout.tp if run.cfg.parallel.sequence_parallel else 1,
                           autocast=loaded.autocast, on_token=printer)
            total_tokens += out.new_tokens
            total_seconds += out.prefill_seconds + out.decode_seconds
            if printer is not None:
                printer.finish()
            elif rank0:
                for i, new in enumerate(out.tokens):
                    print(f"--- prompt {start + i + 1}\n{prompts[start + i]}{tok.decode(new)}", flush=True)
        if rank0:
            print(f"generated {total_tokens} tokens for {len(prompts)} prompt(s) in {total_seconds:.2f}s: "
                  f"{total_tokens / max(total_seconds, 1e-9):.1f} tokens/s", file=sys.stderr, flush=True)
        if dist.get_world_size() > 1:
            dist.barrier()
    finally:
        loaded = model = None
        shutdown()


class _Streamer:
    """Prints one sequence's text as its tokens arrive: the decoded text so far minus what is printed (a token may
    end inside a UTF-8 character, so a trailing replacement character waits for the next token)."""

    def __init__(self, tok, prompt: str):
        self.tok, self.ids, self.printed = tok, [], 0
        print(prompt, end="", flush=True)

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):
            print(text[self.printed:], end="", flush=True)
            self.printed = len(text)

    def finish(self) -> None:
        print(self.tok.decode(self.ids)[self.printed:], flush=True)


def cli(argv: list[str]) -> int:
    try:
        parsed = parse(argv)
        if parsed is None:
            return 0
        main(*parsed)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
