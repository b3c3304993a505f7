"""Generation: the KV cache against full recomputation, sampling filters against a hand computation, greedy tokens
against transformers' generate on the to-hf export, and the launcher's output and one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import run_cli
from hybridpar.config.cli import load_config
from hybridpar.inference.generate import Sampling, filtered_logits, generate, pick
from hybridpar.models import build_model, get_model_config

FAMILIES = {"gpt2": dict(name="tiny", n_layers=2, d_model=64, n_heads=4, vocab_size=384, max_seq_len=64),
            "modern": dict(name="tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, norm="rmsnorm",
                           position="rope", mlp="swiglu", bias=False, vocab_size=384, max_seq_len=64)}


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_logits_equal_full_recomputation(family):
    """Three prompts of 5, 9 and 12 tokens, left-padded into one batch, then 8 tokens one at a time, every other
    call right-padded to 2 tokens (what sequence parallelism over 2 ranks does): each real token's logits equal
    those of the whole sequence run without a cache (causal SDPA, positions from 0)."""
    fields = {k: v for k, v in FAMILIES[family].items() if k != "name"}
    torch.manual_seed(0)
    model = build_model(get_model_config("tiny", **fields), device="cpu").eval()
    seqs = [torch.randint(0, 384, (n + 8,)).tolist() for n in (5, 9, 12)]
    prompts = [s[:n] for s, n in zip(seqs, (5, 9, 12))]
    with torch.no_grad():
        full = [model(torch.tensor([s]))[0] for s in seqs]  # (T, V) each, no cache
        cache = model.new_cache(3, 12 + 8 * 2 + 2)
        x = torch.zeros(3, 12, dtype=torch.long)
        valid = torch.zeros(3, 12, dtype=torch.bool)
        for b, p in enumerate(prompts):
            x[b, 12 - len(p):], valid[b, 12 - len(p):] = torch.tensor(p), True
        out = model(x, cache=cache, valid=valid)
        for b, p in enumerate(prompts):
            torch.testing.assert_close(out[b, 12 - len(p):], full[b][:len(p)], atol=2e-5, rtol=1e-5)
        for t in range(8):
            pad = 2 if t % 2 else 1
            x = torch.zeros(3, pad, dtype=torch.long)
            x[:, 0] = torch.tensor([s[len(p) + t] for s, p in zip(seqs, prompts)])
            valid = torch.zeros(3, pad, dtype=torch.bool)
            valid[:, 0] = True
            out = model(x, cache=cache, valid=valid)
            for b, p in enumerate(prompts):
                torch.testing.assert_close(out[b, 0], full[b][len(p) + t], atol=2e-5, rtol=1e-5)


def test_sampling_filters_match_a_hand_computation():
    """softmax([2, 1, 0.5, 0, -1]) = [.563, .207, .126, .076, .028]: top_k 2 keeps tokens 0 and 1; top_p 0.8 keeps
    0, 1, 2 (the probability ranked above token 2 is .770 < .8, above token 3 .896); temperature divides first."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = [math.exp(v) for v in logits[0].tolist()]
    assert [round(v / sum(p), 3) for v in p] == [0.563, 0.207, 0.126, 0.076, 0.028]
    kept = lambda **kw: torch.isfinite(filtered_logits(logits, Sampling(temperature=1.0, **kw)))[0].tolist()
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.8) == [True, True, True, False, False]
    assert kept(top_p=0.5) == [True, False, False, False, False]  # the most likely token is always kept
    assert kept(top_k=2, top_p=0.8) == [True, True, False, False, False]
    torch.testing.assert_close(filtered_logits(logits, Sampling(temperature=0.5)), logits / 0.5)
    assert pick(logits, Sampling(), torch.Generator()).tolist() == [0]  # greedy
    # Seeded: the same draws for the same seed; top_k 2 never draws outside its two tokens.
    s = Sampling(temperature=1.0, top_k=2)
    a, b, c = ([int(pick(logits, s, g)) for _ in range(200)] for g in
               (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)))
    assert a == b != c and set(a) == {0, 1}
    # 200 draws of p(0) = .563 / (.563 + .207) = .731: within 4 standard deviations (.031)
    assert abs(a.count(0) / 200 - 0.731) < 0.13


def _export(tmp_path, family):
    """A random model's DCP checkpoint (test_convert's helper) and its to-hf export."""
    from test_convert import _checkpoint

    hf_family = "gpt2" if family == "gpt2" else "llama"
    model, ckpt = _checkpoint(tmp_path, hf_family, max_seq_len=64)
    out = run_cli(["launch/convert_checkpoint.py", "to-hf", "--checkpoint", str(ckpt), "--out", str(tmp_path / "hf")])
    assert out.returncode == 0, out.stderr
    return ckpt, tmp_path / "hf"


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_tokens_equal_transformers_generate(tmp_path, family):
    """40 greedy tokens after each of two prompts (6 and 11 tokens, generated together in one left-padded batch)
    from the checkpoint loaded by hybridpar's inference loader, against transformers' generate (its own KV cache)
    on the to-hf export of the same checkpoint, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    from hybridpar.inference.load import load_for_inference
    from hybridpar.parallel.distributed import shutdown

    ckpt, hf_dir = _export(tmp_path, family)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
    prompts = [torch.randint(1, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 11)]
    try:
        loaded = load_for_inference(str(ckpt), load_config([]), "bytes")
        ours = generate(loaded.model, prompts, Sampling(max_new_tokens=40), torch.device("cpu"), eod_id=0)
    finally:
        loaded = None
        shutdown()
    for p, new in zip(prompts, ours.tokens):
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=0,
                                 pad_token_id=0)[0, len(p):].tolist()
        assert len(new) >= 32 and new == theirs[:len(new)], (new, theirs)


@pytest.mark.multiprocess
def test_generate_launcher_streams_batches_runs_under_torchrun_and_refuses_bad_input(tmp_path, capsys):
    """One prompt streams and reports tokens/s; a prompts file runs as one batch whose first text equals the prompt
    run alone; under torchrun (2 gloo ranks, --parallel.tp 2) rank 0 alone prints one process's text. A prompt
    longer than the context, a missing checkpoint, a checkpoint whose config.yaml describes another model, --model
    flags and a bad sampling setting are one line each with exit status 2 (the launcher's cli() in this process)."""
    import shutil

    from conftest import launcher
    from test_convert import _checkpoint

    _, ckpt = _checkpoint(tmp_path, "llama", max_seq_len=64)
    base = ["launch/generate.py", str(ckpt), "--tokenizer", "bytes", "--max-new-tokens", "12", "--no-stop-at-eod"]
    one = run_cli(base + ["hello"])
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("hello") and "generated 12 tokens for 1 prompt(s)" in one.stderr
    assert "tokens/s" in one.stderr
    alone = one.stdout.rstrip("\n")
    (tmp_path / "prompts.txt").write_text("hello\n\nanother prompt\n")
    batch = run_cli(base + ["--prompts-file", str(tmp_path / "prompts.txt")])
    assert batch.returncode == 0, batch.stderr
    assert f"--- prompt 1\n{alone}\n" in batch.stdout and "--- prompt 2\nanother prompt" in batch.stdout
    assert "generated 24 tokens for 2 prompt(s)" in batch.stderr
    two = run_cli(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *base, "hello",
                   "--parallel.tp", "2"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == one.stdout and two.stderr.count("generated 12 tokens") == 1 and "'tp': 2" in two.stderr

    bad_model = tmp_path / "bad"
    shutil.copytree(ckpt, bad_model)
    text = (bad_model / "config.yaml").read_text()
    (bad_model / "config.yaml").write_text(text.replace("n_layers: 2", "n_layers: 3"))
    other_tok = tmp_path / "bpe"  # the same weights, saved with a BPE tokenizer instead of the bytes one
    shutil.copytree(ckpt, other_tok)
    (other_tok / "tokenizer.txt").unlink(missing_ok=True)
    from hybridpar.data.tokenizer import train_bpe

    train_bpe([f"text {i} of a tiny corpus, {i * i}" for i in range(300)], 600).save(str(other_tok / "tokenizer.json"))
    generate_cli, args = launcher("generate").cli, base[1:]
    capsys.readouterr()
    for argv, message in [(args + ["x" * 80], "prompt 1 is 80 tokens; it must hold 1 to 63 tokens"),
                          ([str(tmp_path / "none"), "x"], "does not exist"),
                          ([str(bad_model), "x", "--tokenizer", "bytes"], "holds a different model"),
                          ([str(other_tok), "x", "--tokenizer", "bytes"],
                           f"--tokenizer bytes is not the tokenizer {other_tok} was trained with (bpe:"),
                          (args + ["x", "--prompts-file", "/dev/zero"], "'/dev/zero' is not a regular file"),
                          (args + ["x", "--model.n_layers", "3"], "the model is the checkpoint's"),
                          (args + ["x", "--top-p", "0"], "0 < top_p <= 1")]:
        assert generate_cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (argv, err)
