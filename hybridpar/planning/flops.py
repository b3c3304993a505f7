"""Model FLOPs per token and MFU, as docs/metrics.md writes them out.

Training FLOPs per token (forward + backward = 3 x forward, each multiply-add = 2 FLOPs; Megatron's accounting,
Narayanan et al. 2021, with the attention term halved for the causal mask as PaLM's MFU does):

    6 * N_matmul + 6 * L * T * (n_heads * head_dim)

N_matmul counts the weights of every matrix multiply: per layer Q and O (H x n_heads*hd each), K and V
(H x n_kv_heads*hd each), the MLP (2 or, for SwiGLU, 3 matrices of H x F); plus the LM head (V x H). Embedding
lookups, norms, biases and activations are left out (they are not matmuls). The attention term: QK^T and AV each
cost 2*T*(nh*hd) per token per layer in forward over the full T x T square; causal masking halves it; x3 for
forward + backward. Recomputation by activation checkpointing is not counted: this is model FLOPs (MFU), not
hardware FLOPs. Throughput: a measured step's rates against them (the trainer's log rows).
"""

from __future__ import annotations

from hybridpar.models import ModelConfig

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s per device, from the vendors' datasheets. Matched against
# torch.cuda.get_device_name() in order; a device not listed gets no MFU rather than a guessed peak.
PEAK_BF16_TFLOPS: list[tuple[tuple[str, ...], float]] = [
    (("GB200",), 2500.0),
    (("B200",), 2250.0),
    (("GH200",), 989.4),
    (("H200",), 989.4),
    (("H100", "PCIe"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.4),  # SXM (HBM3)
    (("H800",), 989.4),
    (("A100",), 312.0),
    (("A800",), 312.0),
    (("L40S",), 362.0),
    (("MI300X",), 1307.4),
    (("MI325X",), 1307.4),
]


def matmul_params(cfg: ModelConfig) -> int:
    H, hd = cfg.d_model, cfg.head_dim
    attn = 2 * H * cfg.n_heads * hd + 2 * H * cfg.kv_heads * hd
    mlp = (3 if cfg.mlp == "swiglu" else 2) * H * cfg.ffn_dim
    return cfg.n_layers * (attn + mlp) + cfg.vocab_size * H


def flops_parts(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Training (forward + backward = 3 x forward) model FLOPs per token by part: the blocks' projections and MLPs,
    the attention scores and weighted sums (QK^T and AV over the causal half of the T x T square: 6 x T x H per layer,
    half of PaLM's 12 x L x H x T, which counts the whole square), and the LM head."""
    head = cfg.vocab_size * cfg.d_model
    return {"blocks": 6 * (matmul_params(cfg) - head),
            "attention": 6 * cfg.n_layers * seq_len * cfg.n_heads * cfg.head_dim, "head": 6 * head}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training (forward + backward) model FLOPs per token at sequence length seq_len."""
    return sum(flops_parts(cfg, seq_len).values())


# Dense float8 peaks (NVIDIA H100/H200/B200 and L40S datasheets; twice the bf16 figure on each); GPUs without float8
# tensor cores (A100, A800, MI300X here) are absent: their fp8 MFU is never reported.
PEAK_FP8_TFLOPS: list[tuple[tuple[str, ...], float]] = [
    (("GB200",), 5000.0), (("B200",), 4500.0), (("GH200",), 1978.9), (("H200",), 1978.9), (("H100", "PCIe"), 1513.0),
    (("H100", "NVL"), 1670.0), (("H100",), 1978.9), (("H800",), 1978.9), (("L40S",), 733.0)]


def peak_fp8_tflops(device_name: str | None) -> float | None:
    """The dense float8 peak of a device name, or None (no float8 tensor cores, or unknown)."""
    for keys, peak in PEAK_FP8_TFLOPS if device_name else []:
        if all(k in device_name for k in keys):
            return peak
    return None


def peak_tflops(device_name: str | None) -> float | None:
    """The dense bf16 peak of a device name, or None when unknown (CPUs, unlisted GPUs)."""
    if not device_name:
        return None
    for keys, peak in PEAK_BF16_TFLOPS:
        if all(k in device_name for k in keys):
            return peak
    return None


class Throughput:
    """A step row's rates (docs/metrics.md): tokens/s, model FLOPs per device and MFU against the GPU's peak, the
    slowest and fastest rank's step time, the data wait's share, and on CUDA the memory."""

    def __init__(self, cfg, device):
        import torch

        self.cfg, self.device = cfg, device
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        self.peak_tflops = peak_tflops(name)
        self.peak_fp8_tflops = peak_fp8_tflops(name) if cfg.train.fp8 != "off" else None

    def row(self, step: int, elapsed: float, steps: int, seq_len: int, data_wait: float) -> dict:
        """Over the `steps` steps up to `step` that took `elapsed` seconds (collective: the step-time spread)."""
        import torch
        import torch.distributed as dist

        world, step_time = dist.get_world_size(), elapsed / steps
        spread = torch.tensor([step_time, -step_time], dtype=torch.float64, device=self.device)
        if world > 1:
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        tokens_per_step = self.cfg.train.global_batch_size * seq_len
        per_token = self.flops_per_token if seq_len == self.cfg.train.seq_len else flops_per_token(self.cfg.model,
                                                                                                   seq_len)
        tps = steps * tokens_per_step / elapsed
        tflops = per_token * tps / world / 1e12
        row = {"tokens_per_sec": tps, "tokens_per_sec_per_device": tps / world, "tflops_per_device": tflops,
               "step_time": step_time, "step_time_max": float(spread[0]), "step_time_min": -float(spread[1]),
               "data_time": min(1.0, data_wait / elapsed), "consumed_tokens": step * tokens_per_step}
        if self.peak_tflops:
            row["mfu"] = tflops / self.peak_tflops
        if self.peak_fp8_tflops:
            row["mfu_fp8"] = tflops / self.peak_fp8_tflops
        if self.device.type == "cuda":
            gib = 2 ** 30
            row.update(mem_allocated_gib=torch.cuda.memory_allocated(self.device) / gib,
                       mem_reserved_gib=torch.cuda.memory_reserved(self.device) / gib,
                       mem_peak_gib=torch.cuda.max_memory_allocated(self.device) / gib)
            torch.cuda.reset_peak_memory_stats(self.device)
        return row

