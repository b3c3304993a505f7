"""Plan a run: per-GPU memory by part, an estimated step time, and the layouts that fit, ranked by tokens/s.

    python launch/plan.py --model.name gpt3-175b --cluster.nodes 128 --cluster.gpus_per_node 8 \\
        --parallel.tp 8 --parallel.dp_replicate 2 \\
        --train.global_batch_size 1536 --train.seq_len 2048 --train.micro_batch_size 1 --cluster.gpu h100
    python launch/plan.py --model.name gpt3-1.3b --cluster.gpus_per_node 1 --dry-run --json

Every other argument is a training config override (the layout to report is the config's parallel section; the
world is cluster.nodes x cluster.gpus_per_node). --dry-run also builds the real model on the meta device under a
fake process group of that world size and applies the real parallelize function for --rank's coordinates, then
checks that its parameter, gradient and optimizer bytes equal the planner's. Nothing is written.
"""

from __future__ import annotations

import json
import sys

from dataclasses import dataclass, field, replace

import torch

from hybridpar.config.cli import ConfigError, parse_command
from hybridpar.models.config import doc
from hybridpar.parallel.distributed import MESH_AXES, WorldInfo
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.cost import GIB, GPU, GPUS, OUT_OF_SAMPLE_STEP_ERROR, memory, plan_of, step_time
from hybridpar.planning.layouts import rank_layouts
from hybridpar.resolve import longest_stage, resolve


@dataclass(frozen=True)
class Cluster:
    nodes: int = doc(1, "nodes of the planned cluster")
    gpus_per_node: int = doc(8, "GPUs per node (the bound on tp)")
    gpu: str = doc("h100", f"GPU type, one of {', '.join(GPUS)}")
    internode_gbps: float = doc(0.0, "inter-node bandwidth per GPU in GB/s (0: the GPU type's figure; one 400 Gb/s "
                                     "NIC per GPU is 50)")


def cluster_gpu(c: Cluster) -> GPU:
    """The GPU type's figures, with the cluster's inter-node fabric where it is given."""
    return replace(GPUS[c.gpu], internode_gbps=c.internode_gbps) if c.internode_gbps else GPUS[c.gpu]


@dataclass(frozen=True)
class Options:
    cluster: Cluster = field(default_factory=Cluster, metadata={"help": "the cluster planned for"})
    rank: int = doc(0, "the rank whose shards are reported (0 holds the largest)")
    top: int = doc(10, "how many ranked layouts to list")
    dry_run: bool = doc(False, "also build the real model for --rank on the meta device and compare its bytes")
    json: bool = doc(False, "print one JSON object instead of tables")


def parse(argv: list[str]):
    parsed = parse_command(argv, Options, __doc__.split("\n\n")[0], "launch/plan.py", config=True)
    if parsed is None:
        return None
    a, cfg = parsed
    c = a.cluster
    if c.gpu not in GPUS:
        raise ConfigError(f"--cluster.gpu {c.gpu!r} is not known; use one of {', '.join(GPUS)}")
    if a.top < 0:
        raise ConfigError(f"--top {a.top}: give how many ranked layouts to list, 0 (none) or more")
    if c.nodes < 1 or c.gpus_per_node < 1:
        raise ConfigError(f"--cluster.nodes {c.nodes} --cluster.gpus_per_node {c.gpus_per_node}: both must be >= 1")
    if not 0 <= c.internode_gbps < 1e5:
        raise ConfigError(f"--cluster.internode_gbps {c.internode_gbps} must be a bandwidth in GB/s per GPU (0 for the "
                          f"GPU type's {GPUS[c.gpu].internode_gbps:g})")
    world = c.nodes * c.gpus_per_node
    if not 0 <= a.rank < world:
        raise ConfigError(f"--rank {a.rank} is outside the world of {world} GPUs; pick 0 <= rank < {world}")
    # The model's vocab_size as given (a preset's is padded already); bf16 where unset, as the trainer picks on
    # these GPUs. Then the trainer's own resolve, for rank a.rank of this world, on this GPU type.
    cfg = replace(cfg, model=replace(cfg.model, vocab_from_tokenizer=False),
                  train=replace(cfg.train, precision=cfg.train.precision or "bf16"))
    world_info = WorldInfo(a.rank, world, a.rank % c.gpus_per_node, c.gpus_per_node)
    run = resolve(cfg, world_info, torch.device("meta"), tokenizer=_Vocabulary(cfg.model.vocab_size),
                  gpu=cluster_gpu(c))
    return a, longest_stage(run.cfg, run.stages, run.layout.dp), run.layout, run.layout_choice  # (with stages:
    #                                                                                      the longest's batches)


class _Vocabulary:
    """A tokenizer stand-in for planning without data: only its size."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.spec = vocab_size, f"{vocab_size} tokens"


def report(a, cfg, layout: Layout) -> dict:
    c = a.cluster
    gpu = cluster_gpu(c)
    plan = plan_of(cfg, layout, a.rank)
    # the step is timed on rank 0, whose shards (ceil-sized first) and Muon share are the largest
    mem, est = memory(plan), step_time(plan_of(cfg, layout) if a.rank else plan, gpu, c.gpus_per_node)
    usable = gpu.usable_bytes
    out = {"model": cfg.model.name, "gpu": c.gpu, "nodes": c.nodes, "gpus_per_node": c.gpus_per_node,
           "world_size": layout.world, "rank": a.rank, "layout": dict(zip(MESH_AXES, layout.degrees)),
           "micro_batch_size": cfg.train.micro_batch_size, "global_batch_size": cfg.train.global_batch_size,
           "seq_len": cfg.train.seq_len, "precision": cfg.train.precision,
           "activation_checkpointing": cfg.train.activation_checkpointing, "fsdp_strategy": cfg.parallel.fsdp_strategy,
           "accumulate_unsharded": cfg.parallel.accumulate_unsharded,
           **mem, "usable_bytes_per_gpu": usable, "fits": mem["total_bytes_per_gpu"] <= usable, **est,
           "optimizer": cfg.optim.name, **plan.muon}
    out["ranked"], out["top"] = rank_layouts(cfg, layout.world, c.gpus_per_node, gpu, a.top), a.top
    return out


def print_report(out: dict) -> None:
    g = lambda b: f"{b / GIB:9.2f} GiB"  # noqa: E731
    lay = out["layout"]
    if out.get("layout_choice"):
        print(out["layout_choice"])
    print(f"{out['model']} on {out['nodes']} x {out['gpus_per_node']} {out['gpu']} | dp_replicate "
          f"{lay['dp_replicate']} x dp_shard {lay['dp_shard']}" + (f" x cp {lay['cp']}" if lay["cp"] > 1 else "")
          + f" x tp {lay['tp']} | batch {out['global_batch_size']} "
          f"x {out['seq_len']}, micro {out['micro_batch_size']}, {out['precision']}, AC {out['activation_checkpointing']}, "
          f"accumulate_unsharded {out['accumulate_unsharded']}")
    print(f"memory of rank {out['rank']}:")
    for key in ("params", "grads", "optimizer", "activations", "logits", "fsdp_buffers", "accumulation", "total"):
        print(f"  {key:<13}{g(out[key + '_bytes_per_gpu'])}")
    print(f"  usable       {g(out['usable_bytes_per_gpu'])}  -> {'fits' if out['fits'] else 'DOES NOT FIT'}")
    print(f"step time (estimate) {out['step_time_s']:.3f} s = compute {out['compute_s']:.3f} + TP "
          f"{out['tp_comm_s']:.3f} + CP {out['cp_comm_s']:.3f} + exposed FSDP {out['fsdp_exposed_s']:.3f} (of {out['fsdp_comm_s']:.3f}) + "
          f"selective recompute {out['selective_recompute_s']:.3f} + eager elementwise {out['eager_s']:.3f} + "
          f"optimizer {out['optimizer_s'] + out['muon_ns_s'] + out['muon_comm_s']:.3f} + per-microbatch overhead "
          f"{out['per_microbatch_overhead_s']:.3f} | {out['tokens_per_sec']:,.0f} tokens/s, MFU {out['mfu']:.0%}"
          + (f" of the bf16 peak, {out['mfu_fp8']:.0%} of the fp8 peak" if out.get("mfu_fp8") else ""))
    low, high, rms = OUT_OF_SAMPLE_STEP_ERROR
    print(f"  (step time planned for published runs of frameworks the model was not fitted to: {low:+.0%} to "
          f"{high:+.0%} of the measured, {rms:.0%} RMS; docs/planning.md)")
    if out["optimizer"] == "muon":
        print(f"muon (rank {out['rank']}): Newton-Schulz {out['muon_ns_flops'] / 1e12:.2f} TFLOP "
              f"({out['muon_ns_s']:.3f} s), all-to-all {g(out['muon_comm_bytes'])} sent ({out['muon_comm_s']:.3f} s)")
    if "dry_run_params_bytes" in out:
        print(f"dry run (rank {out['rank']}, coords {out['dry_run_coords']}, {out['dry_run_seconds']:.1f} s): "
              f"params {g(out['dry_run_params_bytes'])} (materialised and initialised in "
              f"{out['dry_run_init_seconds']:.1f} s), grads {g(out['dry_run_grads_bytes'])}, optimizer "
              f"{g(out['dry_run_optimizer_bytes'])} -> {'equal to the plan' if out['dry_run_matches'] else 'DIFFERS'}")
    if out["ranked"]:
        print("layouts that fit, fastest first (of this world, batch and model):")
        print(f"  {'dp_rep':>6} {'dp_shard':>8} {'tp':>3} {'micro':>5} {'AC':>9} {'FSDP':>13} {'accum':>9} {'GiB':>7} "
              f"{'step s':>8} {'tokens/s':>11} {'MFU':>5}")
        for r in out["ranked"]:
            accum = "-" if r["microbatches"] == 1 else ("unsharded" if r["accumulate_unsharded"] else "sharded")
            print(f"  {r['dp_replicate']:>6} {r['dp_shard']:>8} {r['tp']:>3} {r['micro_batch_size']:>5} "
                  f"{r['activation_checkpointing']:>9} {r['fsdp_strategy']:>13} {accum:>9} {r['total_gib']:>7.1f} "
                  f"{r['step_time_s']:>8.3f} "
                  f"{r['tokens_per_sec']:>11,.0f} {r['mfu']:>5.0%}")
    elif out["top"] > 0:
        print("no layout of this world, batch and model fits in memory: add GPUs, or use a smaller model")


def main(argv: list[str]) -> int:
    try:
        parsed = parse(argv)
        if parsed is None:
            return 0
        a, cfg, layout, choice = parsed
        out = report(a, cfg, layout)
        out["layout_choice"] = choice  # parallel.layout=auto: the choice and the runner-up (None otherwise)
        if a.dry_run:
            from hybridpar.planning.dry_run import dry_run

            d = dry_run(cfg, layout.world, a.rank)
            out.update({k: d[k] for k in ("dry_run_params_bytes", "dry_run_grads_bytes", "dry_run_optimizer_bytes",
                                          "dry_run_materialized_bytes", "dry_run_init_seconds",
                                          "dry_run_seconds")}, dry_run_coords=d["coords"],
                       dry_run_local_shapes=d["local_shapes"])
            out["dry_run_matches"] = (d["dry_run_params_bytes"] == out["params_bytes_per_gpu"]
                                      and d["dry_run_materialized_bytes"] == out["params_bytes_per_gpu"]
                                      and d["dry_run_grads_bytes"] == out["grads_bytes_per_gpu"]
                                      and d["dry_run_optimizer_bytes"] == out["optimizer_bytes_per_gpu"]
                                      and all(d.get(f"dry_run_{k}", 0) == out[k]
                                              for k in ("muon_ns_flops", "muon_comm_bytes")))
            out.update({k: d[k] for k in ("dry_run_muon_ns_flops", "dry_run_muon_comm_bytes") if k in d})
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print_report(out)
    return 0 if not a.dry_run or out["dry_run_matches"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
