"""Process group and device mesh: the one place that reads the launcher's environment and builds the mesh.

The mesh has three axes, outermost first: dp_replicate x dp_shard x tp. tp is innermost so that a tensor-parallel
group is a block of consecutive ranks, i.e. inside one node with its fast links; the data-parallel axes span nodes.
A single process (no launcher) gets a world of one, with a real gloo process group on an in-memory store, so the
trainer always runs on a mesh and the single-process path is the distributed path with degrees 1.
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridpar.config import ParallelConfig
from hybridpar.errors import ConfigError

MESH_AXES = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def world_from_env(env=os.environ) -> WorldInfo:
    """Rank and world from torchrun's variables, else SLURM's (srun without torchrun), else a world of one."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return WorldInfo(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        ntasks = int(env["SLURM_NTASKS"])
        local = int(env.get("SLURM_NTASKS_PER_NODE", str(ntasks)).split("(")[0])
        return WorldInfo(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)), local)
    return WorldInfo(0, 1, 0, 1)


def slurm_master(env=os.environ) -> tuple[str, str]:
    """MASTER_ADDR/MASTER_PORT for `srun` without torchrun: the allocation's first host, a port from the job id."""
    import subprocess

    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    return hosts[0], str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)


def resolve_degrees(cfg: ParallelConfig, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) with a -1 filled in; ValueError listing every factor if they don't multiply."""
    degrees = [cfg.dp_replicate, cfg.dp_shard, cfg.tp]
    if -1 in degrees:
        known = 1
        for d in degrees:
            known *= d if d != -1 else 1
        if world_size % known:
            raise ConfigError(f"world size {world_size} is not divisible by the fixed degrees "
                             f"{_describe(degrees)}; choose degrees whose product divides {world_size}")
        degrees[degrees.index(-1)] = world_size // known
    if degrees[0] * degrees[1] * degrees[2] != world_size:
        raise ConfigError(f"parallel degrees {_describe(degrees)} multiply to {degrees[0] * degrees[1] * degrees[2]}, "
                         f"but the world has {world_size} processes; make dp_replicate*dp_shard*tp = {world_size} "
                         f"or set one of them to -1")
    return degrees[0], degrees[1], degrees[2]


def _describe(degrees) -> str:
    return ", ".join(f"{n}={d}" for n, d in zip(MESH_AXES, degrees))


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use --train.device cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    # CPU: set the intra-op thread count explicitly (the same number torch chose). Besides OpenMP this fixes MKL's
    # count for every thread and turns MKL's dynamic thread adjustment off, the conditions under which MKL's GEMMs
    # give the same bits run to run (Intel oneMKL developer guide, "Reproducibility Conditions"). A process that
    # did not call this runs MKL with MKL_DYNAMIC on (MKL_VERBOSE shows "Dyn:1").
    torch.set_num_threads(torch.get_num_threads())
    return torch.device("cpu")


def init_mesh(cfg: ParallelConfig, device: torch.device, world: WorldInfo) -> DeviceMesh:
    """Start the process group (if not started) and build the 3-axis mesh."""
    degrees = resolve_degrees(cfg, world.world_size)
    if not dist.is_initialized():
        backend = cfg.backend or ("nccl" if device.type == "cuda" else "gloo")
        timeout = timedelta(minutes=cfg.timeout_minutes)  # a dead rank ends the job after this, not hours later
        if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            if "MASTER_ADDR" not in os.environ and "SLURM_JOB_NODELIST" in os.environ:  # srun without torchrun
                os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = slurm_master()
            dist.init_process_group(backend, rank=world.rank, world_size=world.world_size, timeout=timeout)
    return init_device_mesh(device.type, degrees, mesh_dim_names=MESH_AXES)


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index in the flattened data-parallel axes (dp_replicate x dp_shard), and their size."""
    r, s = mesh["dp_replicate"], mesh["dp_shard"]
    return r.get_local_rank() * s.size() + s.get_local_rank(), r.size() * s.size()


def shutdown() -> None:
    """Destroy every process group, then collect garbage while the interpreter is fully alive: modules with hooks
    sit in reference cycles and keep DTensors, meshes and so gloo groups alive; a gloo group whose C++ destructor
    runs during interpreter finalization can abort the process ("terminate called without an active exception",
    seen twice in this project's 4-rank test runs)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
