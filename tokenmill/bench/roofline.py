"""The hardware floor of a workload: bytes over copy bandwidth, FLOPs over matmul rate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.config import ModelConfig
from tokenmill.observability.cuda_timing import median_cuda_seconds

# Measured on this workplace's H200 (../shared/device/README.md); used when no GPU is present.
H200_COPY_BANDWIDTH = 4.27e12
H200_MATMUL_FLOPS = 794e12


@dataclass(frozen=True)
class Hardware:
    """Memory bandwidth (bytes/s, read + write) and dense matmul rate (FLOP/s)."""

    bandwidth: float
    matmul_flops: float


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step costs of a model, from its shapes."""

    weight_bytes_per_step: float  # every weight read once per step (not the embedding table)
    flops_per_token: float  # 2 x multiply-accumulates of the weights
    kv_bytes_per_token: float  # K and V of one token, all layers
    attn_flops_per_context_token: float  # QK and PV, per query per context token

    @staticmethod
    def of(cfg: ModelConfig, dtype_bytes: int) -> ModelCost:
        h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
        attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
        mlp = 3 * h * cfg.intermediate_size
        norms = 2 * h + (2 * d if cfg.qk_norm else 0)
        per_layer = attn + mlp + norms
        lm_head = cfg.vocab_size * h
        read = layers * per_layer + lm_head + h
        return ModelCost(
            weight_bytes_per_step=read * dtype_bytes,
            flops_per_token=2.0 * (layers * (attn + mlp) + lm_head),
            kv_bytes_per_token=2.0 * layers * cfg.num_kv_heads * d * dtype_bytes,
            attn_flops_per_context_token=4.0 * layers * cfg.num_heads * d,
        )

    def decode_step_time(self, contexts: np.ndarray, hw: Hardware) -> float:
        """Floor of one decode step for sequences with these context lengths."""
        total_context = float(contexts.sum())
        bytes_moved = self.weight_bytes_per_step + self.kv_bytes_per_token * total_context
        flops = self.flops_per_token * len(contexts)
        flops += self.attn_flops_per_context_token * total_context
        return max(bytes_moved / hw.bandwidth, flops / hw.matmul_flops)

    def prefill_time(self, prompt_lens: np.ndarray, hw: Hardware) -> float:
        """Floor of prefilling these prompts at the matmul rate (causal attention: half)."""
        flops = self.flops_per_token * float(prompt_lens.sum())
        flops += self.attn_flops_per_context_token * float((prompt_lens**2).sum()) / 2
        return flops / hw.matmul_flops


def single_stream_floor(cost: ModelCost, prompt: int, output: int, hw: Hardware) -> float:
    """B1: mean floor time per output token for one sequence decoding `output` tokens."""
    steps = [cost.decode_step_time(np.array([prompt + t]), hw) for t in range(output)]
    return float(np.mean(steps))


def batch_floor(cost: ModelCost, prompts: np.ndarray, outputs: np.ndarray, hw: Hardware) -> float:
    """B2: prefill everything, then decode with the batch shrinking as requests finish."""
    total = cost.prefill_time(prompts, hw)
    for t in range(int(outputs.max())):
        active = outputs > t
        total += cost.decode_step_time(prompts[active] + t, hw)
    return total


def measure_hardware(device: torch.device, repeats: int = 20) -> Hardware:
    """Copy bandwidth (1 GiB device-to-device, bytes read + written) and bf16 matmul rate."""
    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32
    dst = torch.empty_like(src)
    copy_s = median_cuda_seconds(lambda: dst.copy_(src), repeats)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm_s = median_cuda_seconds(lambda: a @ b, repeats)
    return Hardware(bandwidth=2 * src.numel() * 4 / copy_s, matmul_flops=2 * 8192**3 / mm_s)
