"""Process group and device mesh: the one place that reads the launcher's environment and builds the mesh.

The mesh has four axes, outermost first: dp_replicate x dp_shard x cp x tp. tp is innermost so that a tensor-parallel
group is a block of consecutive ranks, i.e. inside one node with its fast links, and a context-parallel group the
next block out; the data-parallel axes span nodes. The cp ranks of a data-parallel rank read the same sequences and
hold two chunks of each (hybridpar.parallel.context); FSDP shards over dp_shard x cp.
A single process (no launcher) gets a world of one, with a real process group (gloo on the CPU) on an in-memory
store, so the trainer always runs on a mesh and the single-process path is the distributed path with degrees 1.
"""

from __future__ import annotations

import gc
import os
import threading
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from hybridpar.config import ParallelConfig
from hybridpar.errors import ConfigError

MESH_AXES = ("dp_replicate", "dp_shard", "cp", "tp")


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
        # SLURM_NTASKS_PER_NODE only with --ntasks-per-node; SLURM_TASKS_PER_NODE ("4(x2)" or "4,4") always
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(ntasks)
        local = int(per_node.split(",")[0].split("(")[0])
        return WorldInfo(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)), local)
    return WorldInfo(0, 1, 0, 1)


def slurm_master(env=os.environ) -> tuple[str, str]:
    """MASTER_ADDR/MASTER_PORT for `srun` without torchrun: the allocation's first host, a port from the job id."""
    import subprocess

    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True).stdout.split()
    return hosts[0], str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)


def resolve_degrees(cfg: ParallelConfig, world_size: int, ranks_per_node: int = 1) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp): fsdp_strategy's layout where the degrees are left at their defaults
    (hybrid_shard: dp_shard = ranks per node / tp; no_shard: dp_shard 1), then a -1 filled from the world size.
    ConfigError listing every factor when they don't multiply out, or when given degrees contradict the name."""
    degrees, strategy = [cfg.dp_replicate, cfg.dp_shard, cfg.tp], cfg.fsdp_strategy
    defaults = cfg.dp_replicate == 1 and cfg.dp_shard == -1 and cfg.tp != -1
    if strategy == "no_shard":
        if cfg.dp_shard not in (-1, 1):
            raise ConfigError(f"parallel.fsdp_strategy=no_shard replicates the model on every data-parallel rank, "
                              f"but parallel.dp_shard={cfg.dp_shard}; drop --parallel.dp_shard or use full_shard")
        degrees[:2] = [-1, 1] if defaults or cfg.dp_replicate == -1 else [cfg.dp_replicate, 1]
    elif strategy == "hybrid_shard":
        if cfg.dp_shard == 1:
            raise ConfigError("parallel.fsdp_strategy=hybrid_shard shards inside a node, but parallel.dp_shard=1 "
                              "shards nothing; use no_shard, or drop --parallel.dp_shard")
        if defaults:
            if ranks_per_node % cfg.tp:
                raise ConfigError(f"parallel.fsdp_strategy=hybrid_shard shards over a node's ranks / tp, but "
                                  f"parallel.tp={cfg.tp} does not divide the {ranks_per_node} ranks per node")
            degrees[:2] = [-1, ranks_per_node // cfg.tp]
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
    return ", ".join(f"{n}={d}" for n, d in zip(("dp_replicate", "dp_shard", "tp"), degrees))


def cuda_index(local_rank: int) -> int:
    """This rank's GPU: its local rank when the node's GPUs are all visible (torchrun, srun without binding), GPU 0
    when the launcher bound one GPU to each task (srun --gpus-per-task=1 or --gpu-bind: CUDA_VISIBLE_DEVICES names
    only that GPU)."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return local_rank
    if count == 1:
        return 0
    raise ConfigError(f"local rank {local_rank} sees {count} GPUs (CUDA_VISIBLE_DEVICES="
                      f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {count} ranks per node, "
                      f"or bind one GPU per task (srun --gpus-per-task=1)")


def gpus_per_node(device: torch.device, world: WorldInfo) -> int | None:
    """GPUs of a node that hybridpar's ranks use (the bound on tp): the ranks on this node, one GPU each, whether
    each rank sees every GPU of the node or only its own. None on the CPU (no such bound)."""
    return world.local_world_size if device.type == "cuda" else None


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is visible; use --train.device cpu")
        index = cuda_index(local_rank)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    # CPU: set the intra-op thread count explicitly (the same number torch chose). Besides OpenMP this fixes MKL's
    # count for every thread and turns MKL's dynamic thread adjustment off, the conditions under which MKL's GEMMs
    # give the same bits run to run (Intel oneMKL developer guide, "Reproducibility Conditions"). A process that
    # did not call this runs MKL with MKL_DYNAMIC on (MKL_VERBOSE shows "Dyn:1").
    torch.set_num_threads(torch.get_num_threads())
    return torch.device("cpu")


def set_numerics(deterministic: bool, tf32: bool) -> None:
    """Kernel choices that change numbers, set before the first GPU kernel runs: deterministic algorithms (cuBLAS
    needs its workspace size fixed before its handle is created) and TF32 matmuls."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = tf32


def start_process_group(cfg: ParallelConfig, device: torch.device, world: WorldInfo) -> None:
    """Start the default process group (once): an in-memory store for a world of one without a launcher."""
    if dist.is_initialized():
        return
    options = process_group_options(cfg, device)
    if world.world_size == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
        return
    if "MASTER_ADDR" not in os.environ and "SLURM_JOB_NODELIST" in os.environ:  # srun without torchrun
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = slurm_master()
    dist.init_process_group(rank=world.rank, world_size=world.world_size, **options)


@dataclass(frozen=True)
class Layout:
    """The degrees of the mesh (dp_replicate, dp_shard, cp, tp; tp innermost): rank = ((rep * dp_shard + shard) * cp
    + cp rank) * tp + tp rank. FSDP shards over dp_shard x cp (fsdp: that size; fsdp_index: a rank's place)."""
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those reading different sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def degrees(self) -> tuple[int, int, int, int]:
        """In MESH_AXES order."""
        return self.dp_replicate, self.dp_shard, self.cp, self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """(replicate, shard, cp, tp) coordinates of a rank."""
        tp, rank = rank % self.tp, rank // self.tp
        cp, rank = rank % self.cp, rank // self.cp
        return rank // self.dp_shard, rank % self.dp_shard, cp, tp

    def fsdp_index(self, rank: int) -> int:
        """A rank's index among the dp_shard x cp ranks FSDP shards over."""
        _, shard, cp, _ = self.coords(rank)
        return shard * self.cp + cp


def init_mesh(degrees: tuple[int, int, int, int], device: torch.device) -> DeviceMesh:
    """The 4-axis mesh (dp_replicate, dp_shard, cp, tp) over the started process group; under context parallelism
    with dp_shard x cp flattened to one axis too, "dp_shard_cp" (FSDP's: hybridpar.parallel.fsdp.dp_mesh_of)."""
    mesh = init_device_mesh(device.type, tuple(degrees), mesh_dim_names=MESH_AXES)
    if mesh["cp"].size() > 1:
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    return mesh


def process_group_options(cfg: ParallelConfig, device: torch.device) -> dict:
    """init_process_group's backend, timeout and, on a GPU, device_id: NCCL then binds the group to this rank's
    GPU at once (its barriers and the first collective do not have to guess the device from the rank)."""
    options = {"backend": cfg.backend or ("nccl" if device.type == "cuda" else "gloo"),
               "timeout": timedelta(minutes=cfg.timeout_minutes)}  # a dead rank ends the job after this
    if device.type == "cuda":
        options["device_id"] = device
    return options


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t: a DTensor's local tensor (to_local(), which autograd follows), any other tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def dp_rank_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index in the flattened data-parallel axes (dp_replicate x dp_shard), and their size."""
    r, s = mesh["dp_replicate"], mesh["dp_shard"]
    return r.get_local_rank() * s.size() + s.get_local_rank(), r.size() * s.size()


def dp_sum(mesh: DeviceMesh):
    """A function summing a tensor in place over the mesh's data-parallel and context-parallel axes (every rank of
    a different sequence or a different part of one: token counts and loss shares add up over them), and returning
    it; the axes' groups are sliced once, here (a mesh slice reads its ranks on the host)."""
    groups = [mesh[a].get_group() for a in ("dp_replicate", "dp_shard", "cp") if mesh[a].size() > 1]

    def total(t: torch.Tensor) -> torch.Tensor:
        for group in groups:
            dist.all_reduce(t, group=group)
        return t
    return total


def watch_agent(on_gone, interval: float = 0.5, stop: threading.Event | None = None) -> int | None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), call on_gone(why) from a daemon thread once the agent that started
    this worker is gone: torchrun starts each worker in a session of its own, so an agent killed with SIGKILL (the
    OOM killer, a scheduler's hard kill) leaves its workers running, and training into the run dir beside the run a
    restart starts. The agent's death shows as this process being re-parented. Returns the agent's pid (None when
    not under torchrun): a collective that fails because a sibling worker already left for this reason is the same
    event, and the caller asks agent_gone(agent) before reporting it as an error. Setting `stop` ends the watch."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    agent = os.getppid()

    stop = stop or threading.Event()

    def watch():
        while (why := agent_gone(agent)) is None:
            if stop.wait(interval):
                return
        on_gone(why)

    threading.Thread(target=watch, name="hybridpar-agent-watch", daemon=True).start()
    return agent


def agent_gone(agent: int | None) -> str | None:
    """Why this worker is orphaned (its torchrun agent, pid `agent`, is gone), or None while it is not."""
    if agent is None or os.getppid() == agent:
        return None
    return f"the torchrun agent (pid {agent}) that started this worker is gone"


def shutdown() -> None:
    """Destroy every process group, then collect garbage while the interpreter is fully alive: modules with hooks
    sit in reference cycles and keep DTensors, meshes and so gloo groups alive; a gloo group whose C++ destructor
    runs during interpreter finalization can abort the process ("terminate called without an active exception",
    seen twice in this project's 4-rank test runs)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
