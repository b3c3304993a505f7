"""megatron-core's own GPTModel on CPU, as the reference for the Megatron-LM interop tests.

    python tests/megatron_harness.py save SPEC OUT          # torch_dist save dir (1 process)
    torchrun --nproc_per_node 2 tests/megatron_harness.py save-legacy SPEC OUT   # legacy torch, TP=2
    python tests/megatron_harness.py load OUT/iter_0000007   # load a torch_dist save into a fresh GPTModel

Each writes the logits of megatron-core's forward on fixed token ids to OUT/logits.pt. The model is built from
an argparse Namespace shaped like Megatron-LM's saved `args`, mapped to a TransformerConfig here (the way
Megatron-LM's training script does it), so the tests never take the mapping from the code they check.

megatron-core asks CUDA for a few things that its CPU path does not need; the shims below give them (tests only):
torch.cuda.current_device -> "cpu", a no-op synchronize, and a null RNG-tracker fork. This file must stay
importable (no work at import time): dist_checkpointing.save starts a multiprocessing manager that re-imports it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from argparse import Namespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

ITERATION = 7
SEQ = 16
SPECS = {
    # GPT-style: learned positions, LayerNorm with biases, exact GELU, tied output layer.
    "gpt": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4, group_query_attention=False,
                ffn_hidden_size=256, padded_vocab_size=128, max_position_embeddings=32, normalization="LayerNorm",
                norm_epsilon=1e-5, position_embedding_type="learned_absolute", add_bias_linear=True,
                add_qkv_bias=True, swiglu=False, openai_gelu=False, untie_embeddings_and_output_weights=False,
                rotary_interleaved=False, rotary_base=10000, rotary_percent=1.0),
    # modern: RoPE (half-split), RMSNorm, SwiGLU, grouped-query attention, untied, no biases.
    "modern": dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, group_query_attention=True,
                   ffn_hidden_size=96, padded_vocab_size=128, max_position_embeddings=32, normalization="RMSNorm",
                   norm_epsilon=1e-6, position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=False,
                   swiglu=True, openai_gelu=False, untie_embeddings_and_output_weights=True,
                   rotary_interleaved=False, rotary_base=500000, rotary_percent=1.0),
    # in between: interleaved RoPE, LayerNorm, bias on Q/K/V only, tanh GELU, GQA, tied.
    "mixed": dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, group_query_attention=True,
                  ffn_hidden_size=128, padded_vocab_size=192, max_position_embeddings=32, normalization="LayerNorm",
                  norm_epsilon=1e-5, position_embedding_type="rope", add_bias_linear=False, add_qkv_bias=True,
                  swiglu=False, openai_gelu=True, untie_embeddings_and_output_weights=False,
                  rotary_interleaved=True, rotary_base=10000, rotary_percent=1.0),
}


def megatron_args(spec: str, tp: int = 1) -> Namespace:
    """The args Megatron-LM would save for SPEC (the fields its checkpoint loader and hybridpar read)."""
    return Namespace(**SPECS[spec], tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                     kv_channels=SPECS[spec]["hidden_size"] // SPECS[spec]["num_attention_heads"],
                     apply_layernorm_1p=False, num_experts=None, multi_latent_attention=False, qk_layernorm=False,
                     seq_length=SEQ, micro_batch_size=2, global_batch_size=8, lr=3e-4, train_iters=100,
                     make_vocab_size_divisible_by=64, params_dtype=torch.float32, iteration=ITERATION)


def _shims() -> None:
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def build(args: Namespace):
    """megatron-core GPTModel for `args`, as Megatron-LM's pretrain_gpt.py builds it (local layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    act = F.silu if args.swiglu else (partial_gelu_tanh if args.openai_gelu else F.gelu)
    cfg = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        gated_linear_unit=args.swiglu, activation_func=act, rotary_interleaved=args.rotary_interleaved,
        tensor_model_parallel_size=args.tensor_model_parallel_size, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=args.normalization),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
                     rotary_percent=args.rotary_percent, parallel_output=False,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    with torch.no_grad():  # biases start at zero in megatron-core: make them count in the comparison
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model.eval()


def partial_gelu_tanh(x):
    return F.gelu(x, approximate="tanh")  # Megatron-LM's openai_gelu


def token_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(0))


def logits(model, vocab: int) -> torch.Tensor:
    ids = token_ids(vocab)
    pos = torch.arange(SEQ)[None].expand(ids.shape[0], -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]  # True = masked (future positions)
    with torch.no_grad():
        return model(ids, pos, mask).float()


def _init(tp: int) -> None:
    from megatron.core import parallel_state

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tp, 1)
    torch.manual_seed(1234)  # use_cpu_initialization draws each full weight from this generator, then splits it


def main(argv: list[str]) -> None:
    _shims()
    from megatron.core import dist_checkpointing

    mode, rest = argv[0], argv[1:]
    if mode in ("save", "save-legacy"):
        spec, out = rest
        tp = 2 if mode == "save-legacy" else 1
        _init(tp)
        args = megatron_args(spec, tp)
        model = build(args)
        iter_dir = os.path.join(out, f"iter_{ITERATION:07d}")
        os.makedirs(iter_dir, exist_ok=True)
        if mode == "save":
            dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": ITERATION,
                                     "checkpoint_version": 3.0}, iter_dir)
        else:  # what Megatron-LM's legacy `--ckpt-format torch` writes: one file per tensor-parallel rank
            rank_dir = os.path.join(iter_dir, f"mp_rank_{dist.get_rank():02d}")
            os.makedirs(rank_dir, exist_ok=True)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model.state_dict()},
                       os.path.join(rank_dir, "model_optim_rng.pt"))
        out_logits = logits(model, args.padded_vocab_size)
        if dist.get_rank() == 0:
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
            torch.save(out_logits, os.path.join(out, "logits.pt"))
    elif mode == "load":  # a torch_dist save (written by hybridpar's to-megatron) into a fresh GPTModel
        (iter_dir,) = rest
        _init(1)
        common = dist_checkpointing.load_common_state_dict(iter_dir)
        model = build(common["args"])
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()  # every value must come from the checkpoint
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, iter_dir)  # as Megatron-LM does
        model.load_state_dict(state["model"])
        torch.save(logits(model, common["args"].padded_vocab_size), os.path.join(iter_dir, "..", "logits.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
