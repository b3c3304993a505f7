"""Megatron tensor parallelism with sequence parallelism, as a DTensor plan applied from outside the model.

Partitioning (Shoeybi et al. 2019). A column-parallel linear Y = X A splits A = [A_1 .. A_tp] by output columns;
rank i computes Y_i = X A_i, so an MLP up-projection or the Q/K/V projections give each rank whole heads / a slice
of the FFN width with no communication. A row-parallel linear Z = Y B splits B by input rows; rank i computes the
partial sum Y_i B_i and the ranks add them. In Megatron's notation, f is identity forward / all-reduce backward at
the entry of the column-parallel region, g is all-reduce forward / identity backward at the exit of the row-parallel
region: one all-reduce each way per attention block and per MLP.

Sequence parallelism (Korthikanti et al. 2022). Between the TP regions (norms, dropout, residual adds) activations
are sharded along the sequence instead of replicated: g becomes a reduce-scatter to sequence shards and f an
all-gather from them. The bytes moved equal the all-reduce's (an all-reduce is a reduce-scatter + all-gather), and
the activation memory of those regions drops by tp.

The vocabulary is split the same way: the input embedding by rows (VocabParallelEmbedding: each rank looks up the
ids in its vocab range and the partial results are summed into sequence shards), the LM head by output columns, its
logits left sharded over the vocab so the loss-parallel cross entropy never materialises [tokens, V] on one rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from hybridpar.parallel.sequence_shard import keep_sequence_shard

# DTensor's styles for Megatron's layers: ColwiseParallel is what Megatron calls ColumnParallelLinear (output features
# split), RowwiseParallel its RowParallelLinear (input features split) and, on an embedding, VocabParallelEmbedding.


def gpt_tp_plan(model: nn.Module, sequence_parallel: bool) -> tuple[dict, dict]:
    """(top-level plan, per-block plan) for hybridpar.models.GPT. `seq` is the layout of the residual stream
    between TP regions: Shard(1) (sequence shards) with SP, Replicate() without."""
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel() if sequence_parallel else None
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "norm": norm,
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if model.pos_embeddings is not None and sequence_parallel:
        # Learned positions: every rank holds the whole (small) table and keeps the rows of its sequence shard (the
        # sequence dim is -2 of the (T, H) lookup of training and of the (B, T, H) one of decoding with a cache).
        top["pos_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(-2))
    block = {
        "attn_norm": norm,
        "attn": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp_norm": norm,
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=seq),
    }
    if model.cfg.mlp == "swiglu":
        block["mlp.gate"] = ColwiseParallel()
    if model.cfg.n_experts:  # an MoE block takes its tp rank's tokens instead (hybridpar/parallel/experts.py)
        block = {k: v for k, v in block.items() if not k.startswith("mlp") or k == "mlp_norm"}
    return ({k: v for k, v in top.items() if v is not None}, {k: v for k, v in block.items() if v is not None})


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
             keep_shards_in_blocks: bool = False) -> None:
    """Shard `model` (on the meta device, before its shards are materialised) over the tp mesh, in place. Under
    sequence parallelism the LM head (and with keep_shards_in_blocks, each block's attention and MLP) keeps its
    input's sequence shard for backward instead of the gathered input (hybridpar/parallel/sequence_shard.py)."""
    top, block = gpt_tp_plan(model, sequence_parallel)
    if model.cfg.tie_embeddings:  # give the LM head its own Parameter to shard; re-tied below
        model.lm_head.weight = nn.Parameter(model.tok_embeddings.weight.detach().clone())
    parallelize_module(model, tp_mesh, top)
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, block)
    model.tie_weights()  # the embedding and the LM head are both Shard(0) over the vocab: one parameter again
    if sequence_parallel:
        keep_sequence_shard(model.lm_head)
        if keep_shards_in_blocks:
            for layer in model.layers:
                keep_sequence_shard(layer.attn)
                if not model.cfg.n_experts:
                    keep_sequence_shard(layer.mlp)
