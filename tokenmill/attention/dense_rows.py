"""A prefill batch's whole long prompts through cuDNN's dense causal attention.

A row with no cached prefix and at least DENSE_MIN_Q_LEN query tokens attends to exactly its
own tokens: a dense causal problem, which cuDNN's fused attention (torch's
`_scaled_dot_product_cudnn_attention`) runs at 65-74% of the H200's matmul rate, against
34-43% for the paged Triton prefill kernel (docs/perf-notes.md, session 26). Its K and V are
read back from the cache at the slots the step wrote them to (contiguous, the query heads'
copies of each KV head made for cuDNN), its output copied into the batch's. The Triton kernel
skips those rows (`prefill_attention(dense_min_len=...)`); rows with a prefix, and every row
inside a CUDA graph, stay with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.attention.backend import AttentionInputs

# Rows of at least this many query tokens (shorter ones gain less than their copies and the
# launches cost), no cached prefix ...
DENSE_MIN_Q_LEN = 1024
# ... and at most this many in a step (each is its own launches, per layer).
DENSE_MAX_ROWS = 8
# A row of n tokens is attended as one of DENSE_BUCKETS_PER_OCTAVE lengths per power of two
# (zero tokens after its own, which its queries never see): cuDNN builds a graph for each new
# shape (hundreds of ms, reported), so every prompt length cannot have its own.
DENSE_BUCKETS_PER_OCTAVE = 8
DENSE_DTYPES = (torch.float16, torch.bfloat16)
DENSE_MAX_HEAD_DIM = 128


class DenseRow(NamedTuple):
    """A dense row: its first query token in the batch, its tokens, and the cache slots of its
    positions 0 .. n - 1 (read through its page table: a warm-up's rows write no K/V, their
    slot mapping is -1, and read page 0 as the Triton kernel does)."""

    start: int
    n: int
    slots: torch.Tensor


def dense_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention serves this device (Ampere or newer, cuDNN present),
    dtype (16-bit floats) and head size (a multiple of 8, at most 128)."""
    if device.type != "cuda" or dtype not in DENSE_DTYPES:
        return False
    if not torch.backends.cudnn.is_available() or head_dim % 8 or head_dim > DENSE_MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def plan_dense_rows(inputs: AttentionInputs, min_q_len: int, page_size: int) -> list[DenseRow]:
    """The rows of a prefill batch that attend densely: at least `min_q_len` (DENSE_MIN_Q_LEN)
    query tokens and no cached prefix, as long as there are at most DENSE_MAX_ROWS of them
    (else none)."""
    found, start = [], 0
    for i, (q_len, kv_len) in enumerate(
        zip(inputs.query_lens_cpu, inputs.kv_lens_cpu, strict=True)
    ):
        if q_len >= min_q_len and kv_len == q_len:
            found.append((i, start, q_len))
        start += q_len
    if len(found) > DENSE_MAX_ROWS:
        return []
    rows = []
    for i, start, n in found:
        positions = torch.arange(n, device=inputs.page_table.device)
        pages = inputs.page_table[i, positions // page_size].to(torch.int64)
        rows.append(DenseRow(start, n, pages * page_size + positions % page_size))
    return rows


def dense_attend(
    rows: list[DenseRow],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Write into `out` the causal attention of each of `rows` (`q` `[T, Hq, D]`) over its own
    tokens, whose K/V are in `k_cache` / `v_cache` `[slots, Hkv, D]`."""
    group = q.shape[1] // k_cache.shape[1]
    for start, n, slots in rows:
        tokens = slice(start, start + n)
        length = dense_length(n)
        k = _heads_first(k_cache.index_select(0, slots), group, length)
        v = _heads_first(v_cache.index_select(0, slots), group, length)
        result = _dense_causal(_heads_first(q[tokens], 1, length), k, v, scale)
        out[tokens] = result[:, :n].transpose(0, 1)


def dense_length(n: int) -> int:
    """The length a row of `n` tokens is attended at: `n` rounded up to one of
    DENSE_BUCKETS_PER_OCTAVE steps of its power of two."""
    step = max(1, (1 << (n.bit_length() - 1)) // DENSE_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def _heads_first(x: torch.Tensor, group: int, length: int) -> torch.Tensor:
    """`[n, H, D]` → `[H * group, length, D]`, each head repeated `group` times (cuDNN's kernel
    takes as many K/V heads as query heads), zeros after the n tokens."""
    n, h, d = x.shape
    padded = x.new_zeros(h, group, length, d)
    padded[:, :, :n] = x.transpose(0, 1)[:, None]
    return padded.view(h * group, length, d)


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """cuDNN's causal attention of `[H, n, D]` queries over `[H, n, D]` keys and values."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q[None], k[None], v[None], None, False, 0.0, True, False, scale=scale
    )[0][0]
