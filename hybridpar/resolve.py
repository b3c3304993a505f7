"""Resolve a config once, into a frozen Run: every derived value and every check, in one written order, before
any model is built or any data prepared. The trainer, launch/plan.py, launch/benchmark.py and the dry run all call
`resolve` (the launchers through `begin`, which starts the process group first); nothing writes the config
afterwards (its dataclasses are frozen).

The order (docs/training.md walks it):
 0. the same config on every rank (compared at once: a rank started with other arguments stops every rank)
 1. run name and dir: run.name (the --config file's name, else the model's), run.dir = runs/<name>
 2. degrees: parallel.fsdp_strategy's names (hybrid_shard, no_shard) and the -1 filled from the world size
    (parallel.layout=auto: chosen at 6);
    the sample count (train.steps x global batch) whose index the data layer must hold in memory; data.stages
 3. precision: bf16 on GPUs that support it, fp32 on the CPU; train.fp8 on this device (torchao importable, float8
    tensor cores on a GPU); the downstream tasks (train.eval_tasks' default)
 4. the run dir's lock (a run owns its dir from here), the checkpoint to load and the W&B id it recorded
 5. the tokenizer, loaded once, and the model's vocabulary from it (padded to vocab_multiple, whatever the layout)
 6. the device's usable memory (the minimum over ranks); with parallel.layout=auto the planner's fastest layout
    that fits it (degrees, FSDP strategy, micro-batch, checkpointing; written as manual); the layout's
    divisibility rules, with the final vocabulary; the micro-batch size
 7. the optimizer state's dtype (optim.state_dtype=auto), the accumulation mode, the memory refusal (with
    data.stages, for the longest stage's sequences)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import torch
import torch.distributed as dist

from hybridpar.checkpoint.layout import latest_checkpoint, resolve_load_path
from hybridpar.checkpoint.resume_checks import read_checkpoint_config, read_run_state
from hybridpar.checkpoint.run_dir import RunDirLock
from hybridpar.config import Config
from hybridpar.data.dataset import check_eval_size, check_sample_count, load_data_tokenizer
from hybridpar.data.stages import StagePlan, stage_micro_batch, stage_plan
from hybridpar.data.tokenizer import Tokenizer
from hybridpar.errors import ConfigError, RunDirError
from hybridpar.metrics import wandb_mode
from hybridpar.parallel import check_layout
from hybridpar.parallel.fp8 import check_fp8
from hybridpar.parallel.context import check_cp
from hybridpar.parallel.experts import check_moe
from hybridpar.parallel.distributed import (Layout, WorldInfo, gpus_per_node, pick_device, resolve_degrees,
                                            start_process_group, world_from_env)
from hybridpar.planning.layouts import (check_auto, choose_layout, describe_choice, gpu_by_name, settle_memory,
                                        usable_bytes)
from hybridpar.planning.cost import GPU, GPUS


@dataclass(frozen=True)
class Run:
    """A resolved run: the final config (no None, auto or -1 left in what was derived) and what was found."""
    cfg: Config
    world: WorldInfo
    device: torch.device
    layout: Layout
    tokenizer: Tokenizer
    run_dir: Path
    load_from: Path | None  # the checkpoint this run starts from
    run_state: Mapping  # that checkpoint's run_state.json ({} without one)
    lock: RunDirLock | None  # held by rank 0 of a run that owns its run dir
    stages: StagePlan | None = None  # data.stages, parsed once (hybridpar.data.stages)
    layout_choice: str | None = None  # the planner's choices (parallel.layout, optim.state_dtype auto), said at start

    @property
    def microbatches(self) -> int:
        return self.cfg.grad_accum_steps(self.layout.dp)


def _broadcast(value):
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _min_over_ranks(value: int, device: torch.device) -> int:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor(value, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank must make the same choices
    return int(t)


def _same_config_on_every_rank(cfg: Config) -> None:
    """Every rank was started with rank 0's config; else every rank raises the same line, naming the first
    field that differs (ranks started by hand or by a script that passes them different arguments or files)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    from hybridpar.config.cli import all_keys, to_dict

    tree = to_dict(cfg)
    mine = {}
    for key in all_keys():
        node = tree
        for part in key.split("."):
            node = node[part]
        mine[key] = node
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    differ = [r for r, other in enumerate(everyone) if other != everyone[0]]
    if differ:
        r = differ[0]
        key = next(k for k in everyone[0] if everyone[0][k] != everyone[r][k])
        raise ConfigError(f"rank(s) {', '.join(map(str, differ))} started with another config than rank 0 ({key}: "
                          f"{everyone[0][key]!r} on rank 0, {everyone[r][key]!r} on rank {r}); start every rank with "
                          f"the same command and config file")


def _lock(run_dir: Path, rank: int) -> RunDirLock | None:
    """Rank 0 takes the run dir's lock; every rank raises RunDirError if it cannot be had."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = RunDirLock(run_dir).acquire()
        except RunDirError as e:
            error = str(e)
    error = _broadcast(error)
    if error is not None:
        raise RunDirError(error)
    return lock


def _checkpoint_to_load(cfg: Config, run_dir: Path) -> Path | None:
    """checkpoint.load, else the latest complete checkpoint in run.dir (auto-resume). A run dir holding metrics but
    no checkpoint is not clobbered, unless its run saved checkpoints and was stopped before the first one completed
    (a requeued job, started again by the same command): nothing is lost by starting it over."""
    if cfg.checkpoint.load:
        return resolve_load_path(cfg.checkpoint.load)
    latest = latest_checkpoint(run_dir)
    if latest is None and (run_dir / "metrics.jsonl").exists() and not cfg.run.overwrite:
        saved = ((read_checkpoint_config(run_dir) or {}).get("checkpoint") or {}).get("interval", 0)
        if isinstance(saved, int) and saved > 0 and cfg.checkpoint.interval > 0:
            return None  # killed before its first checkpoint: starts over from step 0, its metrics replaced
        why = ("its run saved none (checkpoint.interval 0)" if isinstance(saved, int) and saved <= 0 else
               "its run was stopped before its first checkpoint, and this start would save none")
        raise ConfigError(f"run.dir={str(run_dir)!r} already holds a run (metrics.jsonl) without a checkpoint to "
                          f"continue from: {why}; start another run with --run.name NAME, or replace this one with "
                          f"--run.overwrite true")
    return latest


def vocab_size_for(cfg: Config, tokenizer) -> int:
    """With model.vocab_from_tokenizer, the tokenizer's vocabulary padded up to a multiple of vocab_multiple; else
    model.vocab_size, checked to hold the tokenizer's. The layout never enters: tp shards a vocabulary it does not
    divide unevenly (DTensor's Shard(0), torch.chunk's split), so every layout trains the same model."""
    m, need = cfg.model, tokenizer.vocab_size
    pad = m.vocab_multiple
    padded = pad * math.ceil(need / pad)
    if m.vocab_from_tokenizer:
        return padded
    if m.vocab_size < need:
        raise ConfigError(f"tokenizer {tokenizer.spec!r} has {need} tokens but model.vocab_size={m.vocab_size}; set "
                          f"--model.vocab_size {padded}, or leave it out to take the tokenizer's")
    return m.vocab_size


def micro_batch_size_for(cfg: Config, dp: int) -> int:
    """train.micro_batch_size, or the whole per-rank batch when it is None; checked against the global batch."""
    t = cfg.train
    if t.micro_batch_size is None and t.global_batch_size % dp:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by the data-parallel "
                          f"size {dp}; use a multiple of {dp}")
    micro = t.micro_batch_size or t.global_batch_size // dp
    if t.global_batch_size % (micro * dp):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
                          f"{micro} x data-parallel size {dp}; use a multiple of {micro * dp}")
    return micro


def longest_stage(cfg: Config, stages: StagePlan | None, dp: int) -> Config:
    """The config of the run's most memory-hungry batches, for the memory check and the planner: with data.stages,
    the longest stage's sequence length and micro-batch size (hybridpar.data.stages.stage_micro_batch)."""
    if stages is None or max(stages.seq_lens) <= cfg.train.seq_len:
        return cfg
    t, length = cfg.train, max(stages.seq_lens)
    micro = stage_micro_batch(t.micro_batch_size, t.seq_len, length, t.global_batch_size // dp)
    return replace(cfg, train=replace(t, seq_len=length, micro_batch_size=micro))


def precision_for(cfg: Config, device: torch.device) -> str:
    if cfg.train.precision is not None:
        return cfg.train.precision
    return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"


def eval_tasks_for(cfg: Config) -> list[str]:
    if cfg.train.eval_tasks is not None:
        return list(cfg.train.eval_tasks)
    builtin = cfg.data.path == "builtin" and not cfg.data.stages
    return ["builtin:next-words"] if builtin and cfg.train.eval_interval > 0 else []


def resolve(cfg: Config, world: WorldInfo, device: torch.device, own_run_dir: bool = False, tokenizer=None,
            gpu: GPU | None = None) -> Run:
    """The Run of `cfg` on `world` (this process's rank) and `device`, in the order of the module docstring.
    own_run_dir: take the run dir's lock and look for a checkpoint to resume (the trainer's launcher). tokenizer:
    one already loaded, instead of data.tokenizer's. gpu: plan for this GPU type instead of the device (its
    usable memory, world.local_world_size GPUs per node, no refusal: launch/plan.py reports the fit).

    Besides deriving values, resolve acts, in this order: it compares the ranks' configs and takes the minimum of
    their usable memory (collectives, when a process group with several ranks exists), takes the run dir's lock
    (own_run_dir; released again if a later step refuses), reads the checkpoint it will resume from (its
    run_state.json and config.yaml), and loads the tokenizer, or trains it (train-bpe:N, rank 0 first, cached under
    data.cache_dir). It writes nothing else."""
    _same_config_on_every_rank(cfg)  # 0
    run_dir = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / (cfg.run.name or cfg.model.name)  # 1
    cfg = replace(cfg, run=replace(cfg.run, name=cfg.run.name or cfg.model.name, dir=str(run_dir)))
    auto = cfg.parallel.layout == "auto"
    if auto:  # chosen at 6; until then a placeholder of the same world
        check_auto(cfg)
    node = world.local_world_size if gpu is not None else gpus_per_node(device, world)
    cp = cfg.parallel.cp
    if world.world_size % cp:
        raise ConfigError(f"parallel.cp={cp} does not divide the world of {world.world_size} processes; pick a cp "
                          f"that divides it")
    dp_replicate, dp_shard, tp = ((1, world.world_size, 1) if auto else  # (the data and tensor axes of world / cp)
                                  resolve_degrees(cfg.parallel, world.world_size // cp,
                                                  max(1, world.local_world_size // cp)))  # 2
    check_sample_count(cfg)
    check_eval_size(cfg)
    stages = stage_plan(cfg, tp)
    check_cp(cfg, tp, node, [cfg.train.seq_len, *(stages.seq_lens if stages else ())])
    check_fp8(cfg, device, gpu)  # 3
    layout = Layout(dp_replicate, dp_shard, tp, cp)
    parallel = replace(cfg.parallel, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    train = replace(cfg.train, precision=precision_for(cfg, device), eval_tasks=eval_tasks_for(cfg))
    lock = _lock(run_dir, world.rank) if own_run_dir else None  # 4
    try:
        load_from = _checkpoint_to_load(cfg, run_dir) if own_run_dir else None
        run_state = read_run_state(load_from) if load_from is not None else {}
        wandb = cfg.logging.wandb
        wandb_mode(wandb.mode)  # a WANDB_MODE wandb would refuse: refused now, before the run writes anything
        if wandb.id is None and load_from is not None and not cfg.checkpoint.load_weights_only:
            wandb = replace(wandb, id=run_state.get("wandb_id"))
        if tokenizer is None:  # 5
            tokenizer = load_data_tokenizer(cfg.data, stages)
        model = replace(cfg.model, vocab_size=vocab_size_for(cfg, tokenizer))
        cfg = replace(cfg, model=model, parallel=parallel, train=train,
                      logging=replace(cfg.logging, wandb=wandb))
        usable = gpu.usable_bytes if gpu is not None else _min_over_ranks(usable_bytes(device), device)
        choice = None
        if auto:  # 6: the planner's fastest layout that fits (every rank computes the same from the same inputs)
            plan_gpu = gpu or (gpu_by_name(torch.cuda.get_device_name(device)) if device.type == "cuda" else GPUS["h100"])
            cfg, rows = choose_layout(longest_stage(cfg, stages, world.world_size), world.world_size,
                                      node or world.local_world_size, plan_gpu, usable)  # (the CPU: no node bound)
            choice, p = describe_choice(rows), cfg.parallel
            dp_replicate, dp_shard, tp = p.dp_replicate, p.dp_shard, p.tp
            layout, parallel = Layout(dp_replicate, dp_shard, tp), replace(p, layout="manual")
            train = replace(train, micro_batch_size=cfg.train.micro_batch_size,  # (cfg: the longest stage's)
                            activation_checkpointing=cfg.train.activation_checkpointing, ac_every=1)
            cfg = replace(cfg, parallel=parallel, train=train)
            stages = stage_plan(cfg, tp)
        check_layout(cfg, (dp_replicate, dp_shard, tp), node)
        check_moe(cfg, layout, [cfg.train.seq_len, *(stages.seq_lens if stages else ())])
        cfg = replace(cfg, train=replace(train, micro_batch_size=micro_batch_size_for(cfg, layout.dp)))
        check_exact(cfg)
        refuse = gpu is None and device.type == "cuda" and cfg.train.memory_check  # refuse what cannot fit, now
        accumulate, state = settle_memory(longest_stage(cfg, stages, layout.dp), layout, usable, node,
                                          torch.cuda.get_device_name(device) if refuse else None)  # 7
        if state != cfg.optim.state_dtype:  # optim.state_dtype=auto
            choice = "\n".join(filter(None, [choice, f"optim.state_dtype auto: {state} moments (the plan with fp32 "
                                                      f"moments {'fits' if state == 'fp32' else 'does not fit'} "
                                                      f"{usable / 2 ** 30:.1f} GiB per GPU)"]))
        cfg = replace(cfg, parallel=replace(parallel, accumulate_unsharded=accumulate),
                      optim=replace(cfg.optim, state_dtype=state))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Run(cfg, world, device, layout, tokenizer, run_dir, load_from, MappingProxyType(dict(run_state)), lock,
               stages, choice)


def check_exact(cfg: Config) -> None:
    """parallel.exact_reduction's needs and bounds (hybridpar.parallel.exact): the mode's module, which imports
    torch-private FSDP classes, is imported only once torch is known to have them."""
    t, p = cfg.train, cfg.parallel
    if not p.exact_reduction:
        return
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ConfigError(f"parallel.exact_reduction needs FSDP2's custom reduce-scatter, which torch "
                          f"{torch.__version__} lacks (FSDPModule.set_custom_reduce_scatter; torch 2.13 has it): "
                          f"install a newer torch, or set parallel.exact_reduction false")
    from hybridpar.parallel.exact import MAX_MICROBATCHES

    if cfg.model.dropout > 0:
        raise ConfigError(f"parallel.exact_reduction with model.dropout={cfg.model.dropout}: a rank draws its masks "
                          f"for the microbatches it holds, so each layout drops other elements and no two layouts "
                          f"agree: set model.dropout 0, or parallel.exact_reduction false")
    if t.precision == "bf16" and p.dp_shard == 1 and p.dp_replicate > 1:
        raise ConfigError("parallel.exact_reduction in bf16 needs parallel.dp_shard > 1 when dp_replicate > 1 (FSDP "
                          "would add the replicas' gradients in float): shard instead, or train in fp32")
    if t.global_batch_size // t.micro_batch_size > MAX_MICROBATCHES:
        raise ConfigError(f"parallel.exact_reduction sums at most {MAX_MICROBATCHES} microbatches a step; "
                          f"train.global_batch_size={t.global_batch_size} / train.micro_batch_size="
                          f"{t.micro_batch_size} makes {t.global_batch_size // t.micro_batch_size}: raise "
                          f"train.micro_batch_size")


def begin(cfg: Config, own_run_dir: bool = False, tokenizer=None) -> Run:
    """The first half of every start-up (training, inference, benchmarks): this process's world and device, the
    process group, then resolve (with own_run_dir, the run dir's lock taken and the checkpoint to resume found)."""
    world = world_from_env()
    device = pick_device(cfg.train.device, world.local_rank)
    start_process_group(cfg.parallel, device, world)
    try:
        return resolve(cfg, world, device, own_run_dir=own_run_dir, tokenizer=tokenizer)
    except ConfigError as e:
        e.on_every_rank = True  # resolve compares the ranks' configs first: every rank raised this one
        raise
