"""Autoregressive sampling from a trained model (greedy or with temperature), for the end-of-run sample."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int, context: int, temperature: float,
             device: torch.device, seed: int = 0) -> list[int]:
    """The prompt followed by max_new_tokens sampled tokens. Re-runs the model on the last `context` tokens for
    each new token (no KV cache: the sample is short). Every rank samples the same tokens (seeded generator), so a
    parallelized model can run it on all ranks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-context:]], device=device)
        logits = model(x)[0, -1].float()  # (V,)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
    model.train(was_training)
    return ids
