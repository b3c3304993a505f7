"""The pipeline-free scheduler: gradient accumulation equals one big batch, normalised by global target tokens."""

from __future__ import annotations

import torch

from hybridpar.training.microbatch import IGNORE_INDEX, count_target_tokens, forward_backward_no_pipelining, token_loss_sum
from hybridpar.models import build_model, get_model_config


def _grads_after(model_state, microbatches):
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", n_layers=2), device="cpu")
    model.load_state_dict(model_state)
    n = count_target_tokens(microbatches)
    loss = forward_backward_no_pipelining(model, microbatches, n, torch.device("cpu"))
    return float(loss), {k: p.grad.clone() for k, p in model.named_parameters()}


def _batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 4096, (4, 32), generator=g)
    y = torch.randint(0, 4096, (4, 32), generator=g)
    y[0, :20] = IGNORE_INDEX  # microbatches with unequal numbers of target tokens
    y[3, 5:9] = IGNORE_INDEX
    return x, y


def test_two_microbatches_of_two_equal_one_of_four():
    torch.manual_seed(0)
    state = build_model(get_model_config("tiny", n_layers=2), device="cpu").state_dict()
    x, y = _batch()
    loss1, g1 = _grads_after(state, [(x, y)])
    loss2, g2 = _grads_after(state, [(x[:2], y[:2]), (x[2:], y[2:])])
    loss4, g4 = _grads_after(state, [(x[i:i + 1], y[i:i + 1]) for i in range(4)])
    assert abs(loss1 - loss2) < 1e-5 and abs(loss1 - loss4) < 1e-5
    # A second implementation as the reference: torch's own token-mean cross entropy over the whole batch.
    ref = build_model(get_model_config("tiny", n_layers=2), device="cpu")
    ref.load_state_dict(state)
    want = torch.nn.functional.cross_entropy(ref(x).flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
    want.backward()
    want = want.item()
    assert abs(loss1 - want) < 1e-5 * want
    for k, p in ref.named_parameters():
        torch.testing.assert_close(g1[k], p.grad, atol=1e-6, rtol=1e-5)
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g4[k], g1[k], atol=1e-6, rtol=1e-5)


def test_loss_is_global_token_mean_not_mean_of_microbatch_means():
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", n_layers=2, tie_embeddings=False), device="cpu")
    x, y = _batch()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # a sharp model, so that microbatch losses can differ
        logits = model(x)
        y[2:] = logits[2:].argmax(-1)  # the second microbatch is easy for it, the first is random
        want = float(token_loss_sum(logits, y) / (y != IGNORE_INDEX).sum())
        per_micro = [float(token_loss_sum(logits[i:i + 2], y[i:i + 2]) / (y[i:i + 2] != IGNORE_INDEX).sum())
                     for i in (0, 2)]
    loss = float(forward_backward_no_pipelining(model, [(x[:2], y[:2]), (x[2:], y[2:])],
                                                count_target_tokens([(x, y)]), torch.device("cpu")))
    assert abs(loss - want) < 1e-4 * want
    assert abs(sum(per_micro) / 2 - want) > 0.05 * want  # the naive average of microbatch means differs


class _SyncRecorder(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, []

    def set_requires_gradient_sync(self, flag):
        self.calls.append(flag)

    def set_reshard_after_backward(self, flag):
        self.calls.append(("reshard", flag))

    def forward(self, x):
        return self.model(x)


def test_gradient_sync_only_on_last_microbatch():
    wrapped = _SyncRecorder(build_model(get_model_config("tiny", n_layers=1), device="cpu"))
    x, y = _batch()
    forward_backward_no_pipelining(wrapped, [(x[i:i + 1], y[i:i + 1]) for i in range(4)], 100, torch.device("cpu"))
    assert wrapped.calls == [False, ("reshard", False)] * 3 + [True, ("reshard", True)]
