"""Autoregressive sampling from a trained model (greedy or with temperature), for the end-of-run sample."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, context: int, temperature: float,
             device: torch.device, seed: int = 0, pad_multiple: int = 1) -> list[int]:
    """The prompt followed by max_new_tokens sampled tokens. Re-runs the model on the last `context` tokens for
    each new token (no KV cache: the sample is short). Every rank samples the same tokens (seeded generator), so a
    parallelized model can run it on all ranks. With pad_multiple > 1 (sequence parallelism needs the length to
    divide by tp) the input is right-padded; causal attention keeps the padding from reaching real positions."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        window = ids[-context:]
        pad = -len(window) % pad_multiple
        x = torch.tensor([window + [0] * pad], device=device)
        logits = model(x)
        if hasattr(logits, "full_tensor"):  # vocab-sharded logits of a tensor-parallel LM head
            logits = logits.full_tensor()
        logits = logits[0, len(window) - 1].float()  # (V,)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
    model.train(was_training)
    return ids
