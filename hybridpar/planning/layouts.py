"""Which layouts a world allows, ranked by the planner's step time among those that fit; and the choices a starting
run makes from its device's memory: unsharded or sharded gradient accumulation, and the refusal of a plan that
cannot fit (naming the fastest layout that does). The byte and time model itself is hybridpar.planning.cost.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, replace
from typing import Iterator

import torch

from hybridpar.config import Config
from hybridpar.errors import ConfigError
from hybridpar.parallel import uses_fsdp
from hybridpar.parallel.distributed import Layout
from hybridpar.planning.cost import GIB, GPU, GPUS, RESERVED_GIB, RUNTIME_RESERVE_GIB, memory, plan_of, step_time


# -- search --------------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(cfg: Config, world: int, gpus_per_node: int) -> Iterator[Config]:
    """Every layout of `world` GPUs the config's model and batch allow: tp within a node, dp_replicate across
    node groups (HSDP), each micro-batch size that divides the per-rank batch, each activation-checkpointing mode,
    parameters resharded after forward (full_shard), kept until backward (shard_grad_op) or resharded to a node (N),
    and both accumulation modes where a step has several microbatches."""
    from hybridpar.parallel import check_layout

    nodes = max(1, world // gpus_per_node)
    for tp in _divisors(min(world, gpus_per_node)):
        dp = world // tp
        if cfg.train.global_batch_size % dp:
            continue
        for rep in [r for r in _divisors(dp) if r <= nodes]:
            for micro in _divisors(cfg.train.global_batch_size // dp):
                for ac in ("none", "selective", "full"):
                    shard, node = dp // rep, gpus_per_node // tp
                    options = ["full_shard", "shard_grad_op"] + ([node] if 1 < node < shard and shard % node == 0
                                                                 else [])
                    accumulate = [True, False] if micro * dp < cfg.train.global_batch_size else [False]
                    for strategy, unsharded in itertools.product(options if shard > 1 else ["full_shard"],
                                                                 accumulate):
                        c = replace(cfg, parallel=replace(cfg.parallel, tp=tp, dp_replicate=rep, dp_shard=dp // rep,
                                                          fsdp_strategy=strategy, accumulate_unsharded=unsharded),
                                    train=replace(cfg.train, micro_batch_size=micro, activation_checkpointing=ac,
                                                  ac_every=1))
                        try:
                            check_layout(c, (rep, dp // rep, tp), gpus_per_node)
                        except ValueError:
                            continue
                        if unsharded and not uses_fsdp(c, dp):
                            continue  # nothing to hold without FSDP: the False row is the same layout
                        yield c


def batch_unfit(cfg: Config, world: int, gpus_per_node: int) -> str:
    """Why no layout of `world` GPUs can run the config's global batch at all (no data-parallel size of theirs
    divides it), with the nearest batches that fit; "" when one does."""
    if next(candidate_layouts(cfg, world, gpus_per_node), None) is not None:
        return ""
    from hybridpar.parallel import check_layout

    def allowed(tp: int) -> bool:  # (the model splits tp ways: the batch aside)
        try:
            check_layout(cfg, (1, world // tp, tp), gpus_per_node)
            return True
        except ValueError:
            return False

    batch = cfg.train.global_batch_size
    dps = sorted({world // tp for tp in _divisors(min(world, gpus_per_node)) if world % tp == 0 and allowed(tp)})
    if dps and all(batch % dp for dp in dps):
        step = dps[0]
        near = sorted({max(step, batch // step * step), -(-batch // step) * step})
        return (f"train.global_batch_size {batch} is not a multiple of any data-parallel size this model allows "
                f"on {world} GPU(s) ({', '.join(map(str, dps))}); give a multiple of {step}, e.g. {' or '.join(map(str, near))}")
    return ""


def rank_layouts(cfg: Config, world: int, gpus_per_node: int, gpu: GPU, top: int = 10) -> list[dict]:
    """The `top` layouts that fit in memory, fastest first."""
    if top <= 0:
        return []
    rows = []
    for c in candidate_layouts(cfg, world, gpus_per_node):
        layout = Layout(c.parallel.dp_replicate, c.parallel.dp_shard, c.parallel.tp)
        plan = plan_of(c, layout)
        mem = memory(plan)
        if mem["total_bytes_per_gpu"] > gpu.usable_bytes:
            continue
        rows.append({**asdict(layout), "micro_batch_size": c.train.micro_batch_size,
                     "fsdp_strategy": c.parallel.fsdp_strategy if plan.fsdp else "-",
                     "accumulate_unsharded": plan.unsharded, "microbatches": plan.n_micro,
                     "activation_checkpointing": c.train.activation_checkpointing,
                     "total_gib": mem["total_bytes_per_gpu"] / GIB, **step_time(plan, gpu, gpus_per_node)})
    # Equal estimates: the larger micro-batch first, then the smaller memory.
    rows.sort(key=lambda r: (-round(r["tokens_per_sec"], 6), -r["micro_batch_size"], r["total_gib"]))
    return rows[:top]


# The fields parallel.layout=auto chooses, with the defaults they must keep in the config it starts from.
AUTO_FIELDS = {"parallel.tp": 1, "parallel.dp_replicate": 1, "parallel.dp_shard": -1,
               "parallel.fsdp_strategy": "full_shard", "parallel.accumulate_unsharded": "auto",
               "train.micro_batch_size": None, "train.activation_checkpointing": "none", "train.ac_every": 1}


def check_auto(cfg: Config) -> None:
    """parallel.layout=auto chooses AUTO_FIELDS: ConfigError (one line) when one of them was set."""
    given = [f"{key}={getattr(getattr(cfg, key.split('.')[0]), key.split('.')[1])!r}" for key, default in
             AUTO_FIELDS.items() if getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) != default]
    if given:
        raise ConfigError(f"parallel.layout=auto chooses the layout, but {', '.join(given)} is set; drop "
                          f"{'it' if len(given) == 1 else 'them'}, or keep them with --parallel.layout manual")


def choose_layout(cfg: Config, world: int, gpus_per_node: int, gpu: GPU, usable: int) -> tuple[Config, list[dict]]:
    """parallel.layout=auto: the config with the fastest ranked layout of `world` GPUs that fits `usable` bytes
    (rank_layouts, timed with `gpu`'s figures), and the two best rows (choice, runner-up). ConfigError when none fits."""
    fitted = replace(gpu, memory_gib=usable / GIB + RESERVED_GIB)
    auto_state = cfg.optim.state_dtype == "auto"  # fp32 moments where a layout fits with them, else bf16
    cfg = replace(cfg, optim=replace(cfg.optim, state_dtype="fp32")) if auto_state else cfg
    rows = rank_layouts(cfg, world, gpus_per_node, fitted, top=2)
    if not rows and auto_state:
        cfg = replace(cfg, optim=replace(cfg.optim, state_dtype="bf16"))
        rows = rank_layouts(cfg, world, gpus_per_node, fitted, top=2)
    if not rows:
        unfit = batch_unfit(cfg, world, gpus_per_node)
        if unfit:
            raise ConfigError(f"parallel.layout=auto: {unfit}")
        raise ConfigError(f"parallel.layout=auto: no layout of {world} GPU(s) fits this model and batch in "
                          f"{usable / GIB:.1f} GiB per GPU; add GPUs, lower train.global_batch_size or shrink the model")
    best = rows[0]
    parallel = replace(cfg.parallel, tp=best["tp"], dp_replicate=best["dp_replicate"], dp_shard=best["dp_shard"],
                       accumulate_unsharded=best["accumulate_unsharded"],
                       fsdp_strategy=cfg.parallel.fsdp_strategy if best["fsdp_strategy"] == "-"
                       else best["fsdp_strategy"])
    train = replace(cfg.train, micro_batch_size=best["micro_batch_size"],
                    activation_checkpointing=best["activation_checkpointing"], ac_every=1)
    return replace(cfg, parallel=parallel, train=train), rows


def describe_choice(rows: list[dict]) -> str:
    """The start-up line of parallel.layout=auto: the choice and the runner-up, with the planner's figures."""
    def one(r: dict) -> str:
        return (f"dp_replicate {r['dp_replicate']} x dp_shard {r['dp_shard']} x tp {r['tp']}, micro-batch "
                f"{r['micro_batch_size']} x {r['microbatches']}, {r['activation_checkpointing']} checkpointing"
                + (f", fsdp {r['fsdp_strategy']}" + (", unsharded accumulation" if r["accumulate_unsharded"] else "")
                   if r["fsdp_strategy"] != "-" else "")
                + f": {r['total_gib']:.1f} GiB, {r['step_time_s']:.3g} s/step planned")
    return ("layout auto: " + one(rows[0])
            + (f"; runner-up: {one(rows[1])}" if len(rows) > 1 else "; no other layout fits"))


def layout_flags(row: dict) -> str:
    """The command-line flags that select a ranked layout (rank_layouts' row)."""
    flags = (f"--parallel.dp_replicate {row['dp_replicate']} --parallel.dp_shard {row['dp_shard']} --parallel.tp "
             f"{row['tp']} --train.micro_batch_size {row['micro_batch_size']} --train.activation_checkpointing "
             f"{row['activation_checkpointing']}")
    if row["fsdp_strategy"] != "-":
        flags += f" --parallel.fsdp_strategy {row['fsdp_strategy']}"
        if row["microbatches"] > 1:
            flags += f" --parallel.accumulate_unsharded {str(row['accumulate_unsharded']).lower()}"
    return flags


def gpu_by_name(device_name: str) -> GPU:
    """The GPUS entry whose key appears in a device name (e.g. "NVIDIA H200" -> h200); h100 figures otherwise."""
    return next((g for key, g in GPUS.items() if key in device_name.lower()), GPUS["h100"])


def choose_accumulation(cfg: Config, layout: Layout, usable_bytes: int) -> bool:
    """parallel.accumulate_unsharded for this run: the setting when it is true or false; for auto, true when
    holding the unsharded model between microbatches fits `usable_bytes` (it always saves collectives: one
    reduce-scatter per step and no re-gather in forward), else false."""
    value = cfg.parallel.accumulate_unsharded
    if cfg.parallel.exact_reduction:  # every microbatch is reduced on its own (hybridpar.parallel.exact)
        if value is True:
            raise ConfigError("parallel.exact_reduction reduces every microbatch on its own: leave "
                              "parallel.accumulate_unsharded at auto or false")
        return False
    if value != "auto":
        return bool(value)
    held = plan_of(replace(cfg, parallel=replace(cfg.parallel, accumulate_unsharded=True)), layout)
    return held.unsharded and memory(held)["total_bytes_per_gpu"] <= usable_bytes


def usable_bytes(device) -> int:
    """What this run may allocate on `device`, now: on a GPU its free memory (cudaMemGetInfo, so the CUDA context
    and other processes are already out) less RUNTIME_RESERVE_GIB; on the CPU the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free - int(RUNTIME_RESERVE_GIB * GIB)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def refuse_if_too_big(cfg: Config, layout: Layout, usable: int, gpus_per_node: int, gpu: GPU,
                      device_name: str = "this GPU") -> None:
    """Before anything is allocated: ConfigError (one line) when the planned per-GPU total exceeds `usable` bytes
    (usable_bytes of the device), naming the planned figure and the fastest layout of this world that fits."""
    need = memory(plan_of(cfg, layout))["total_bytes_per_gpu"]
    if need <= usable:
        return
    fitted = replace(gpu, memory_gib=usable / GIB + RESERVED_GIB)
    best = rank_layouts(cfg, layout.world, gpus_per_node, fitted, top=1)
    if best:
        hint = (f"the planner's fastest layout that fits: {layout_flags(best[0])} ({best[0]['total_gib']:.1f} GiB), "
                f"which --parallel.layout auto chooses by itself")
    else:
        hint = f"no layout of {layout.world} GPU(s) fits this model and batch: add GPUs or shrink the model"
    raise ConfigError(f"the plan needs {need / GIB:.1f} GiB per GPU but {device_name} has {usable / GIB:.1f} GiB "
                      f"usable; {hint}; --train.memory_check false starts anyway")


def choose_state_dtype(cfg: Config, layout: Layout, usable_bytes: int) -> str:
    """optim.state_dtype for this run: the setting when it is fp32 or bf16; for auto, fp32 when the plan with fp32
    moments fits `usable_bytes` (with sharded accumulation, which needs the least), else bf16."""
    if cfg.optim.state_dtype != "auto":
        return cfg.optim.state_dtype
    lean = replace(cfg, optim=replace(cfg.optim, state_dtype="fp32"),
                   parallel=replace(cfg.parallel, accumulate_unsharded=False))
    return "fp32" if memory(plan_of(lean, layout))["total_bytes_per_gpu"] <= usable_bytes else "bf16"


def settle_memory(cfg: Config, layout: Layout, usable: int, gpus_per_node: int,
                  device_name: str | None) -> tuple[bool, str]:
    """optim.state_dtype (choose_state_dtype) and parallel.accumulate_unsharded (choose_accumulation) for this run;
    with a device_name (a GPU run with train.memory_check), refuse_if_too_big on the config with them."""
    state = choose_state_dtype(cfg, layout, usable)
    cfg = replace(cfg, optim=replace(cfg.optim, state_dtype=state))
    accumulate = choose_accumulation(cfg, layout, usable)
    if device_name is not None:
        held = replace(cfg, parallel=replace(cfg.parallel, accumulate_unsharded=accumulate))
        refuse_if_too_big(held, layout, usable, gpus_per_node, gpu_by_name(device_name), device_name)
    return accumulate, state
