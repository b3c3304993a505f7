"""The run's configuration: a tree of typed dataclasses, one per section, every field with a one-line docstring.

Sections: model, parallel, train, optim, data, checkpoint, spike, logging (with logging.wandb), profile, run. Each validates its
own fields in __post_init__; `Config.__post_init__` checks what spans sections (batch arithmetic, sequence length
against the model's context). Every section is frozen: what depends on the world, the device or the data is derived
once by hybridpar.resolve, into a new Config. Loading from YAML and the command line lives in hybridpar.config.cli.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from hybridpar.config.data import DataConfig, check_choices, merge_windows  # noqa: F401  (merge_windows: re-exported)
from hybridpar.models import get_model_config
from hybridpar.models.config import ModelConfig, doc


def _positive(section: str, **values) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            raise ValueError(f"{section}.{name}={v} must be > 0")


@dataclass(frozen=True)
class ParallelConfig:
    layout: Literal["manual", "auto"] = doc(
        "manual", "manual: the degrees, micro-batch and checkpointing as set; auto: the planner's fastest layout that "
        "fits this world and the device's free memory (tp, dp_replicate x dp_shard, fsdp_strategy, "
        "accumulate_unsharded, train.micro_batch_size, train.activation_checkpointing), printed at start with the "
        "runner-up and written into the run's config.yaml; those fields must then be left at their defaults")
    dp_replicate: int = doc(1, "data-parallel replicas (HSDP replicate axis, usually across node groups)")
    dp_shard: int = doc(-1, "data-parallel shards (FSDP axis); -1 fills world / (dp_replicate * tp)")
    tp: int = doc(1, "tensor-parallel degree, inside a node (the innermost mesh axis)")
    cp: int = doc(1, "context-parallel degree: each sequence split over cp ranks (two chunks each, i and 2cp-1-i, "
                     "so causal attention's work is even), keys and values all-gathered over them; FSDP shards over "
                     "dp_shard x cp (docs/parallelism.md#context-parallelism)")
    ep: int = doc(1, "expert-parallel degree of a mixture of experts: groups of ep ranks inside dp_shard x cp hold "
                     "model.n_experts / ep experts each and exchange tokens by all-to-all (docs/moe.md)")
    backend: Optional[str] = doc(None, "process-group backend; None = nccl on CUDA, gloo on CPU")
    sequence_parallel: bool = doc(True, "shard norms/dropout/residuals along the sequence between TP regions (when tp > 1)")
    fsdp_strategy: Union[Literal["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"], int] = doc(
        "full_shard", "what FSDP shards and when a block's parameters are resharded after its forward: full_shard "
        "(resharded over dp_shard, gathered again for backward), shard_grad_op (kept gathered until backward), "
        "hybrid_shard (full_shard inside a node, replicated across nodes: dp_shard = ranks per node / tp unless the "
        "degrees are given), no_shard (every data-parallel rank holds the whole model: dp_shard 1), or an integer N "
        "(full_shard whose backward re-gathers from groups of N ranks, a divisor of dp_shard between 1 and it, e.g. "
        "a node's GPUs / tp)")
    fsdp_prefetch: int = doc(1, "blocks whose parameters are all-gathered ahead of use, in forward and in backward "
                                "(1 = the next block, FSDP2's own default; 2+ overlaps more, holds more memory)")
    accumulate_unsharded: Union[Literal["auto"], bool] = doc(
        "auto", "with FSDP and 2+ microbatches per step: true keeps every block's parameters gathered and its "
        "gradients unsharded (fp32) between microbatches, reducing once per step (fewest collectives, about 6 bytes "
        "per tensor-parallel-local parameter in bf16, 8 in fp32); false reduce-scatters and reshards after every "
        "microbatch's backward (under HSDP the cross-replica all-reduce still runs once per step); auto = true "
        "where the planner says it fits the device's free memory")
    exact_reduction: bool = doc(False, "sum gradients as integers on a grid every layout shares, so that the "
                                       "parameters after every step are bitwise the same for any dp_replicate x "
                                       "dp_shard (tp fixed): docs/parallelism.md#exact-reduction; reduce-scatters "
                                       "every microbatch (accumulate_unsharded false), at most 1,024 microbatches")
    timeout_minutes: float = doc(10.0, "collective timeout: a rank that stops answering ends the job after this long")
    fsdp_cpu_offload: bool = doc(False, "keep sharded parameters, gradients and optimizer state in CPU memory "
                                        "(the optimizer step runs on the CPU); for models that do not fit otherwise")

    def __post_init__(self):
        check_choices("parallel", self)
        for name in ("dp_replicate", "dp_shard", "tp"):
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ValueError(f"parallel.{name}={v} must be a positive degree or -1 (fill the rest)")
        if self.cp < 1:
            raise ValueError(f"parallel.cp={self.cp} must be a positive degree (1: no context parallelism)")
        if self.ep < 1:
            raise ValueError(f"parallel.ep={self.ep} must be a positive degree (1: no expert parallelism)")
        if [self.dp_replicate, self.dp_shard, self.tp].count(-1) > 1:
            raise ValueError("only one of parallel.dp_replicate, dp_shard, tp may be -1")
        if not 0 < self.timeout_minutes <= 43200:  # timedelta overflows long before 1e300 minutes
            raise ValueError(f"parallel.timeout_minutes={self.timeout_minutes} must be in (0, 43200] (30 days)")
        if isinstance(self.fsdp_strategy, int) and self.fsdp_strategy < 2:
            raise ValueError(f"parallel.fsdp_strategy={self.fsdp_strategy}: an integer reshard group must be >= 2 "
                             f"(or use full_shard, shard_grad_op, hybrid_shard, no_shard)")
        if self.fsdp_prefetch < 1:
            raise ValueError(f"parallel.fsdp_prefetch={self.fsdp_prefetch} must be >= 1 (1 = the next block)")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = doc(200, "optimizer steps to run; 0 with checkpoint.interval > 0 writes the initial weights as a "
                          "seed checkpoint (step 0) and stops")
    micro_batch_size: Optional[int] = doc(
        None, "sequences per microbatch per data-parallel rank; None = global_batch_size / data-parallel size "
        "(one microbatch per step, no accumulation)")
    global_batch_size: int = doc(32, "sequences per optimizer step, all ranks and microbatches together")
    seq_len: int = doc(128, "tokens per training sequence (at most model.max_seq_len)")
    seed: int = doc(1234, "seed of initialisation, data order and dropout")
    precision: Optional[Literal["fp32", "bf16"]] = doc(
        None, "fp32, or bf16 compute with fp32 master weights and reductions; None = bf16 on GPUs that support it, fp32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = doc("auto", "auto = cuda when available, else cpu")
    activation_checkpointing: Literal["none", "full", "selective"] = doc(
        "none", "recompute activations in backward: full = whole blocks (every train.ac_every-th one; ~1/3 more "
        "compute), selective = each residual branch keeps its input and the outputs of its matmuls but the last and "
        "of fused attention, and recomputes the cheap rest (norms, RoPE, activations; no matmul FLOPs)")
    ac_every: int = doc(1, "full activation checkpointing: checkpoint blocks 0, k, 2k, ... (1 = every block)")
    compile: bool = doc(False, "torch.compile each transformer block")
    loss_chunk_tokens: int = doc(4096, "with tp = 1: LM head + cross entropy fused, in chunks of this many tokens, so "
                                       "the [tokens, vocab] logits never exist at once; 0 = plain logits then loss "
                                       "(tp > 1 always uses the vocab-parallel loss)")
    deterministic: bool = doc(False, "deterministic kernels (torch.use_deterministic_algorithms, cuBLAS workspace "
                                     ":4096:8): on a GPU, bitwise-repeatable steps and resumes at some speed cost; "
                                     "see docs/checkpoints.md")
    tf32: bool = doc(False, "fp32 runs on a GPU: TF32 tensor-core matmuls (10-bit mantissa inputs, fp32 accumulate), "
                            "several times faster than strict fp32; off = torch's default, exact fp32")
    memory_check: bool = doc(True, "on a GPU, refuse to start when the planner's per-GPU total exceeds the device's "
                                   "usable memory (and name the best layout that fits); false starts anyway")
    grad_clip: float = doc(1.0, "clip the global gradient norm to this value; 0 disables clipping")
    spike: Literal["off", "warn", "rewind"] = doc(
        "warn", "loss spikes (the spike section's test): off; warn (a console line and a metrics row); rewind (back to "
        "the newest checkpoint before the spike, skip its batches, continue; docs/training.md)")
    max_skipped_steps: int = doc(5, "optimizer steps with a non-finite gradient norm are skipped; more than this "
                                    "many in a row stop the run")
    eval_interval: int = doc(50, "run validation every this many steps (and at the first and last step); 0 = never")
    eval_batches: int = doc(8, "microbatches of the validation split per evaluation")
    eval_tasks: Optional[list[str]] = doc(
        None, "downstream tasks scored during training: task files (.jsonl, .txt; docs/evaluation.md) or "
        "builtin:next-words (comma-separated on the command line); None = builtin:next-words on the built-in corpus "
        "when validation runs (train.eval_interval > 0), else none")
    eval_tasks_interval: int = doc(100, "score train.eval_tasks every this many steps, and at the first and last "
                                        "step; 0 = at the first and last step only")
    eval_tasks_batch_size: int = doc(16, "sequences per forward when scoring tasks (the same batches on every layout)")
    fp8: Literal["off", "tensorwise", "rowwise"] = doc(
        "off", "float8 matmuls in train.fp8_linears (torchao: pip install -e \".[fp8]\"): tensorwise (a scale per "
        "tensor: fastest, float8 all-gathers), rowwise (a scale per row: closer to bf16); emulated on CPU; a GPU needs "
        "compute capability >= 8.9 (docs/training.md#fp8)")
    fp8_linears: Literal["hidden", "all"] = doc("hidden", "what train.fp8 converts: hidden (every block's attention and "
                                                          "MLP projections) or all (also the LM head)")
    fp8_all_gather: bool = doc(True, "train.fp8=tensorwise under FSDP: all-gather the converted weights in float8 "
                                     "(half of bf16's bytes), their scales in one all-reduce per step")
    sample_tokens: int = doc(120, "tokens to sample at the end of the run; 0 = no sample")
    sample_prompt: str = doc("The ", "prompt of the end-of-run sample")
    sample_temperature: float = doc(0.8, "sampling temperature; 0 = greedy")

    def __post_init__(self):
        check_choices("train", self)
        if self.loss_chunk_tokens < 0:
            raise ValueError(f"train.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 0 (0 = plain logits)")
        if self.max_skipped_steps < 0:
            raise ValueError(f"train.max_skipped_steps={self.max_skipped_steps} must be >= 0")
        if self.steps < 0:
            raise ValueError(f"train.steps={self.steps} must be >= 0 (0 = start up, save a seed checkpoint with "
                             f"checkpoint.interval > 0, and stop)")
        _positive("train", micro_batch_size=self.micro_batch_size, ac_every=self.ac_every,
                  global_batch_size=self.global_batch_size, seq_len=self.seq_len, eval_batches=self.eval_batches,
                  eval_tasks_batch_size=self.eval_tasks_batch_size)
        if not 0 <= self.seed < 2**32:  # numpy's and megatron-core's seed range
            raise ValueError(f"train.seed={self.seed} must be in [0, 2**32)")
        negative = [f"train.{k}={getattr(self, k)}" for k in ("grad_clip", "eval_interval", "eval_tasks_interval",
                                                               "sample_tokens", "sample_temperature")
                    if getattr(self, k) < 0]
        if negative:
            raise ValueError(f"{', '.join(negative)}: must be >= 0")


MAX_LR = 10.0  # above any peak learning rate that trains (AdamW ~1e-4..1e-2, Muon ~0.02)
MAX_NS_STEPS = 100  # Newton-Schulz iterations: 5 converge for Muon's quintic


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["adamw", "muon"] = doc(
        "adamw", "adamw, or muon: Muon (momentum orthogonalised by Newton-Schulz) for the blocks' hidden matrices "
        "(wq, wk, wv, wo, gate, up, down), AdamW (lr, betas, eps) for embeddings, LM head, norms and biases")
    lr: float = doc(3e-3, "peak learning rate (AdamW's; Muon's too unless optim.muon_lr is set)")
    min_lr: float = doc(3e-4, "learning rate at the end of the decay")
    schedule: Literal["cosine", "linear", "constant", "wsd"] = doc(
        "cosine", "after warmup: cosine or linear decay to min_lr, constant, or warmup-stable-decay")
    warmup_steps: int = doc(20, "linear warmup from 0 to lr over this many steps")
    decay_steps: Optional[int] = doc(None, "wsd: length of the final linear decay; None = 20% of train.steps")
    weight_decay: float = doc(0.1, "AdamW decoupled weight decay, applied to matrices only (not biases, norms)")
    beta1: float = doc(0.9, "AdamW beta1")
    beta2: float = doc(0.95, "AdamW beta2")
    eps: float = doc(1e-8, "AdamW epsilon")
    muon_lr: Optional[float] = doc(None, "Muon's peak learning rate, scheduled like lr; None = optim.lr (with "
                                         "muon_scale=match_rms_adamw, AdamW's lr carries over)")
    muon_momentum: float = doc(0.95, "Muon's momentum: its buffer is an average of gradients with this decay, in "
                                     "[0, 1)")
    muon_nesterov: bool = doc(True, "Nesterov momentum: orthogonalise (1 - m) grad + m buffer instead of the buffer")
    muon_ns_steps: int = doc(5, "Newton-Schulz iterations (quintic, coefficients 3.4445, -4.7750, 2.0315)")
    muon_scale: Literal["match_rms_adamw", "original"] = doc(
        "match_rms_adamw", "Muon's update scale: 0.2 sqrt(max(rows, cols)), the RMS of an AdamW update (Moonlight), "
        "or sqrt(max(1, rows / cols)) (Muon's original rule)")
    muon_distribution: Literal["owner", "gather"] = doc(
        "owner", "owner: each matrix is assembled and orthogonalised on one of the ranks holding it (round-robin), "
        "two all-to-alls a step; gather: every rank all-gathers and orthogonalises every matrix (small models)")
    fused: Optional[bool] = doc(None, "fused AdamW kernel; None = on where every parameter is on a GPU (the CUDA "
                                      "default), off on CPU")
    foreach: Optional[bool] = doc(None, "without the fused kernel: the foreach (multi-tensor) AdamW; None = torch's "
                                        "choice (foreach on CUDA, the per-tensor loop on CPU)")
    state_dtype: Literal["fp32", "bf16", "auto"] = doc(
        "fp32", "AdamW's moments: fp32 (8 bytes a parameter), or bf16 (4: rounded to nearest when stored, the update "
        "computed in fp32; the weights stay fp32); auto: fp32, or bf16 when the plan does not fit the device with "
        "fp32 moments (said at start); docs/training.md#low-precision-optimizer-state says what it costs")
    master_dtype: Literal["fp32", "bf16"] = doc(
        "fp32", "the weights the optimizer updates (and their gradients): fp32 master weights (4 + 4 bytes a "
        "parameter), or bf16 (2 + 2; needs train.precision bf16), each update rounded as optim.master_rounding says")
    master_rounding: Literal["stochastic", "kahan"] = doc(
        "stochastic", "bf16 master weights: stochastic rounding (unbiased; its random bits a hash of the seed, the "
        "step and each element's position in the whole tensor, so every layout rounds alike), or kahan (a bf16 "
        "compensation buffer keeps what rounding dropped: 2 bytes a parameter more, deterministic)")

    def __post_init__(self):
        check_choices("optim", self)
        _positive("optim", lr=self.lr, eps=self.eps, decay_steps=self.decay_steps, muon_lr=self.muon_lr,
                  muon_ns_steps=self.muon_ns_steps)
        for name in ("lr", "muon_lr"):  # a step of that size leaves float range within a few steps (NaN weights)
            if (getattr(self, name) or 0) > MAX_LR:
                raise ValueError(f"optim.{name}={getattr(self, name)} is above {MAX_LR:g}: such a step overflows the "
                                 f"weights to NaN; peak rates are around 1e-4..1e-2 (AdamW) and 0.02 (Muon)")
        if self.muon_ns_steps > MAX_NS_STEPS:
            raise ValueError(f"optim.muon_ns_steps={self.muon_ns_steps} is above {MAX_NS_STEPS}: each iteration is "
                             f"three matmuls of every hidden matrix in every step; 5 converges (Muon's default)")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError("optim.warmup_steps and optim.weight_decay must be >= 0")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"optim.{name}={getattr(self, name)} must be in [0, 1)")
        low = self.state_dtype != "fp32"  # (auto may choose bf16: refused where bf16 would be)
        if low and self.name != "adamw":
            raise ValueError(f"optim.state_dtype={self.state_dtype} is AdamW's (optim.name={self.name}); use "
                             f"optim.name=adamw or optim.state_dtype=fp32")
        for name in ("beta1", "beta2"):  # a moment rounded to nearest in bf16 moves only by more than half an ulp
            if low and 1 - getattr(self, name) < 2 ** -7:
                raise ValueError(f"optim.state_dtype={self.state_dtype} with optim.{name}={getattr(self, name)}: a "
                                 f"step moves the "
                                 f"moment by {1 - getattr(self, name):.2%} of the gradient's difference from it, under "
                                 f"bf16's rounding (0.4-0.8%), so it stops tracking; use optim.{name} <= 0.99 or "
                                 f"optim.state_dtype=fp32")
        if low and self.fused:
            raise ValueError(f"optim.state_dtype={self.state_dtype} runs hybridpar's own AdamW for bf16 moments, not "
                             f"torch's fused kernel: drop optim.fused true")
        if self.master_dtype == "bf16" and self.name != "adamw":
            raise ValueError(f"optim.master_dtype=bf16 is AdamW's (optim.name={self.name}); use optim.name=adamw or "
                             f"optim.master_dtype=fp32")
        if self.master_dtype == "bf16" and self.fused:
            raise ValueError("optim.master_dtype=bf16 runs hybridpar's own AdamW (its rounding), not torch's fused "
                             "kernel: drop optim.fused true")


@dataclass(frozen=True)
class SpikeConfig:
    window: int = doc(50, "steps of loss (and gradient norm) history a step is tested against")
    zscore: float = doc(6.0, "a loss spike: more than this many standard deviations above the window's mean ...")
    min_rise: float = doc(0.1, "... and at least this fraction above it (guards a window that is almost flat)")
    grad_norm_zscore: float = doc(0.0, "test the gradient norm (before clipping) the same way; 0 = not tested")
    grad_norm_min_rise: float = doc(1.0, "the gradient norm's rise above the window's mean, as a fraction")
    skip: int = doc(10, "rewind: the global batches skipped, those of the spiking step and the steps before it")
    max_rewinds: int = doc(3, "rewinds per run; a spike after that many stops the run (exit 3)")
    lr_scale: float = doc(1.0, "rewind: multiply the learning rate by this ...")
    lr_steps: int = doc(0, "... for this many steps after the rewind's checkpoint (0 = never)")
    keep_in_memory: int = doc(2, "rewind: host-memory copies kept of the newest checkpoints (a rewind to one reads "
                                 "nothing from disk); 0 = read the checkpoint back")
    rerun: Literal["off", "same", "rotate"] = doc(
        "off", "rewind: replay up to the spiking step first and compare: same (the same ranks) or rotate (each "
               "data-parallel rank computes its neighbour's batch); the same loss means the data, another a fault "
               "(the ranks that differ are named, nothing is skipped)")

    def __post_init__(self):
        _positive("spike", window=self.window, zscore=self.zscore, skip=self.skip, lr_scale=self.lr_scale)
        if self.window < 2:
            raise ValueError(f"spike.window={self.window} must be >= 2 (a standard deviation needs two steps)")
        if self.lr_scale > 1:
            raise ValueError(f"spike.lr_scale={self.lr_scale} must be in (0, 1]: it lowers the learning rate after a "
                             f"rewind (e.g. 0.5)")
        if self.min_rise < 0 or self.grad_norm_zscore < 0 or self.grad_norm_min_rise < 0:
            raise ValueError("spike.min_rise, spike.grad_norm_zscore and spike.grad_norm_min_rise must be >= 0")
        if self.max_rewinds < 0 or self.lr_steps < 0 or self.keep_in_memory < 0:
            raise ValueError("spike.max_rewinds, spike.lr_steps and spike.keep_in_memory must be >= 0")
        check_choices("spike", self)


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = doc(0, "save a sharded (DCP) checkpoint every this many steps and at the end; 0 = never")
    keep_last: int = doc(2, "complete checkpoints to keep (older ones are deleted once a newer one is complete)")
    load: Optional[str] = doc(None, "checkpoint (or run directory: its latest) to start from; None = the latest "
                                    "complete checkpoint in run.dir, if any (auto-resume)")
    load_weights_only: bool = doc(False, "take only the model weights from checkpoint.load: a new run from step 0 "
                                         "(fine-tuning, re-warming) with a fresh optimizer")
    async_save: bool = doc(False, "write checkpoints in the background; the step loop blocks only for the copy "
                                  "to CPU memory")
    allow_data_change: bool = doc(False, "resume although train.seed, train.seq_len, data.path, data.split, the "
                                         "tokenizer or data.stages differ from the checkpoint's (the data position "
                                         "then indexes other samples; changed stages apply from the resume batch, "
                                         "each source continuing where it was); recorded in metrics.jsonl")

    def __post_init__(self):
        if self.interval < 0 or self.keep_last < 1:
            raise ValueError("checkpoint.interval must be >= 0 and checkpoint.keep_last >= 1")


@dataclass(frozen=True)
class WandbConfig:
    mode: Optional[Literal["online", "offline", "disabled"]] = doc(
        None, "W&B mode; None = online when an API key is set (WANDB_API_KEY or `wandb login`), else offline "
              "(written under the run dir, uploaded later with `wandb sync`)")
    project: str = doc("hybridpar", "W&B project")
    entity: Optional[str] = doc(None, "W&B entity (team or user)")
    name: Optional[str] = doc(None, "W&B run name; None = run.name")
    group: Optional[str] = doc(None, "W&B group")
    tags: list[str] = doc([], "W&B tags (comma-separated on the command line)")
    dir: Optional[str] = doc(None, "where W&B writes; None = <run.dir>")
    id: Optional[str] = doc(None, "W&B run id; None = a new one, or the one a resumed checkpoint recorded")

    def __post_init__(self):
        check_choices("logging.wandb", self)
        # W&B's own rule for run ids (it refuses others after the run dir exists), checked before anything is written
        if self.id is not None and (not re.fullmatch(r"[A-Za-z0-9_.-]{1,128}", self.id) or set(self.id) == {"."}):
            raise ValueError(f"logging.wandb.id={self.id!r}: a W&B run id is 1-128 letters, digits, '_', '-' or '.' "
                             f"(not only dots); e.g. --logging.wandb.id run-042")


@dataclass(frozen=True)
class LoggingConfig:
    interval: int = doc(10, "log metrics every this many steps (and at the last step)")
    tensorboard: bool = doc(False, "also write the metrics as TensorBoard events under <run.dir>/tensorboard")
    wandb: WandbConfig = field(default_factory=WandbConfig, metadata={"help": "Weights & Biases"})

    def __post_init__(self):
        _positive("logging", interval=self.interval)


@dataclass(frozen=True)
class ProfileConfig:
    steps: Optional[str] = doc(None, "profile steps A-B (e.g. 10-12) with torch.profiler; a Chrome trace per rank "
                                     "goes to <run.dir>/profile/")
    memory_snapshot: bool = doc(False, "with profile.steps on CUDA: also dump a CUDA memory snapshot of those steps "
                                       "(view it at pytorch.org/memory_viz)")

    def __post_init__(self):
        if self.steps is not None:
            a, _, b = str(self.steps).partition("-")
            if not (a.strip().isdigit() and b.strip().isdigit() and 1 <= int(a) <= int(b)):
                raise ValueError(f"profile.steps={self.steps!r}: give a step range A-B with 1 <= A <= B, e.g. 10-12")

    @property
    def range(self) -> tuple[int, int] | None:
        if self.steps is None:
            return None
        a, _, b = str(self.steps).partition("-")
        return int(a), int(b)


@dataclass(frozen=True)
class RunConfig:
    dir: Optional[str] = doc(None, "run directory (config.yaml, metrics.jsonl, ...); None = runs/<name>")
    name: Optional[str] = doc(None, "run name; None = the --config file's name without .yaml, else model.name (stable: "
                                    "the same command continues the same run)")
    overwrite: bool = doc(False, "allow a run.dir that already holds a run's metrics (they are replaced)")

    def __post_init__(self):
        if self.name is not None and (not self.name.strip() or "/" in self.name or self.name in (".", "..")):
            raise ValueError(f"run.name={self.name!r} must be a plain name (no '/', not '.' or '..'): it names the "
                             f"directory runs/<name>; give the place itself with --run.dir")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=lambda: get_model_config("tiny"), metadata={
        "help": "architecture; model.name picks a zoo preset (python launch/model_zoo.py), the other fields override "
                "it; the defaults shown are those of the default preset, tiny"})
    parallel: ParallelConfig = field(default_factory=ParallelConfig, metadata={"help": "device mesh"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "training loop"})
    optim: OptimConfig = field(default_factory=OptimConfig, metadata={"help": "optimizer and LR schedule"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "data"})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata={"help": "checkpoints"})
    spike: SpikeConfig = field(default_factory=SpikeConfig, metadata={"help": "loss-spike test and rewinds "
                                                                               "(train.spike)"})
    logging: LoggingConfig = field(default_factory=LoggingConfig, metadata={"help": "metrics and logging"})
    profile: ProfileConfig = field(default_factory=ProfileConfig, metadata={"help": "profiler"})
    run: RunConfig = field(default_factory=RunConfig, metadata={"help": "run identity and directory"})

    def __post_init__(self):
        t = self.train
        if t.seq_len > self.model.max_seq_len:
            raise ValueError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={self.model.max_seq_len} of "
                             f"{self.model.name}; lower train.seq_len or raise model.max_seq_len")
        if t.fp8 != "off" and t.fp8_linears == "all" and self.model.tie_embeddings:
            raise ValueError("train.fp8_linears=all converts the LM head, whose weight is the embedding's "
                             "(model.tie_embeddings); use --train.fp8_linears hidden or --model.tie_embeddings false")
        if t.micro_batch_size is not None and t.global_batch_size % t.micro_batch_size:
            raise ValueError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                             f"train.micro_batch_size={t.micro_batch_size}")
        if self.optim.schedule == "wsd" and self.optim.decay_steps and self.optim.decay_steps > t.steps:
            raise ValueError(f"optim.decay_steps={self.optim.decay_steps} exceeds train.steps={t.steps}")
        if t.spike == "rewind" and self.checkpoint.interval == 0:
            raise ValueError("train.spike=rewind goes back to a checkpoint: set --checkpoint.interval N (e.g. 50), or "
                             "use --train.spike warn")
        if self.optim.master_dtype == "bf16" and t.precision != "bf16":
            raise ValueError(f"optim.master_dtype=bf16 holds the weights in bf16, which computes in bf16: set "
                             f"--train.precision bf16 (train.precision={t.precision})")
        if self.optim.master_dtype == "bf16" and (self.parallel.exact_reduction or t.fp8 != "off"):
            raise ValueError("optim.master_dtype=bf16 with " + ("parallel.exact_reduction (its integer reduction is "
                             "of fp32 gradients)" if self.parallel.exact_reduction else f"train.fp8={t.fp8} (not "
                             "tested with bf16 weights)") + ": use optim.master_dtype=fp32")
        if self.optim.name == "muon" and self.parallel.fsdp_cpu_offload:
            raise ValueError("optim.name=muon with parallel.fsdp_cpu_offload=true: Muon's all-to-alls run where the "
                             "process group does and offloaded matrices stay in host memory; turn one off")

    def grad_accum_steps(self, dp_size: int) -> int:
        """Microbatches per optimizer step on each data-parallel rank."""
        return self.train.global_batch_size // (self.train.micro_batch_size * dp_size)
