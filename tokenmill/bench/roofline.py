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


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for `tokens` tokens, each choosing `top_k` of
    `num_experts` (uniformly: an expert is missed by one token with probability 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


@dataclass(frozen=True)
class ModelCost:
    """Per-token and per-step costs of a model, from its shapes. A mixture of experts reads,
    besides its dense weights, the experts its tokens choose (`weight_bytes`)."""

    dense_weight_bytes: float  # weights every step reads once (not the embedding table)
    flops_per_token: float  # 2 x multiply-accumulates of the weights a token uses
    logits_flops: float  # the LM head's share of flops_per_token: run only where a token samples
    kv_bytes_per_token: float  # K and V of one token, all layers
    attn_flops_per_context_token: float  # QK and PV, per query per context token
    expert_bytes: float = 0.0  # one expert of every sparse layer
    num_experts: int = 0
    top_k: int = 0

    @staticmethod
    def of(cfg: ModelConfig, dtype_bytes: int) -> ModelCost:
        h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
        attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
        dense_mlp = 3 * h * cfg.intermediate_size
        norms = 2 * h + (2 * d if cfg.qk_norm else 0)
        moe = cfg.moe
        sparse = sum(moe.is_sparse(i) for i in range(layers)) if moe else 0
        experts, top_k = (moe.num_experts, moe.top_k) if moe else (0, 0)
        expert = 3 * h * moe.intermediate_size if moe else 0
        # Read at every step by a sparse layer: the router, and a shared expert and its gate.
        shared = moe.shared_expert_intermediate_size if moe else 0
        routed = h * experts + (3 * h * shared + h if shared else 0)
        # Per token: every layer's attention, the dense layers' MLPs, top-k experts + the rest.
        mlp_macs = (layers - sparse) * dense_mlp + sparse * (top_k * expert + routed)
        lm_head = cfg.vocab_size * h
        dense = layers * (attn + norms) + (layers - sparse) * dense_mlp + sparse * routed
        return ModelCost(
            dense_weight_bytes=(dense + lm_head + h) * dtype_bytes,
            flops_per_token=2.0 * (layers * attn + mlp_macs + lm_head),
            logits_flops=2.0 * lm_head,
            kv_bytes_per_token=2.0 * layers * cfg.num_kv_heads * d * dtype_bytes,
            attn_flops_per_context_token=4.0 * layers * cfg.num_heads * d,
            expert_bytes=sparse * expert * dtype_bytes,
            num_experts=experts,
            top_k=top_k,
        )

    def weight_bytes(self, tokens: int) -> float:
        """Weights a step of `tokens` tokens reads: the dense ones and the experts touched."""
        if not self.num_experts:
            return self.dense_weight_bytes
        touched = expected_experts_touched(self.num_experts, self.top_k, tokens)
        return self.dense_weight_bytes + self.expert_bytes * touched

    def decode_step_time(self, contexts: np.ndarray, hw: Hardware) -> float:
        """Floor of one decode step for sequences with these context lengths."""
        total_context = float(contexts.sum())
        bytes_moved = self.weight_bytes(len(contexts)) + self.kv_bytes_per_token * total_context
        flops = self.flops_per_token * len(contexts)
        flops += self.attn_flops_per_context_token * total_context
        return max(bytes_moved / hw.bandwidth, flops / hw.matmul_flops)

    def sequence_flops(self, prompt_lens: np.ndarray, output_lens: np.ndarray) -> float:
        """FLOPs of running sequences with these prompt and output lengths to the end: every
        token but the last output runs the layers, attending causally to itself and the tokens
        before it; the LM head runs only where a token is sampled (the prompt's last position
        and each output token fed back)."""
        fed = prompt_lens.astype(np.float64) + output_lens - 1
        layers = (self.flops_per_token - self.logits_flops) * float(fed.sum())
        attention = self.attn_flops_per_context_token * float((fed * (fed + 1) / 2).sum())
        return layers + attention + self.logits_flops * float(output_lens.sum())

    def prefill_time(self, prompt_lens: np.ndarray, hw: Hardware) -> float:
        """Floor of prefilling these prompts (one token sampled each) at the matmul rate."""
        return self.sequence_flops(prompt_lens, np.ones_like(prompt_lens)) / hw.matmul_flops


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
