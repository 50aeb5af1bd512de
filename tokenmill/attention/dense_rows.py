"""A prefill batch's whole long prompts through cuDNN's dense causal attention.

A row with no cached prefix and at least DENSE_MIN_Q_LEN query tokens attends to exactly its
own tokens: a dense causal problem, which cuDNN's fused attention (torch's
`_scaled_dot_product_cudnn_attention`) runs at 56-72% of the H200's matmul rate for 4k-8k
tokens, against 42-45% for the paged Triton prefill kernel (docs/perf-notes.md, session 27).
Nothing is copied for it: the step's rotary kernel writes its K and V by token as well as to
the cache (`rope_and_store(fresh=...)`), and cuDNN reads the row's queries, keys and values in
place (token-major, its KV heads shared by their query heads); only its output is copied into
the batch's. The Triton kernel skips those rows (`prefill_attention(dense_min_len=...)`); rows
with a prefix, and every row inside a CUDA graph, stay with it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.attention.backend import AttentionInputs

# Rows of at least this many query tokens (below, cuDNN gains little over the Triton kernel:
# 39% against 34% at 2k tokens for Qwen3-0.6B's 16 heads), no cached prefix ...
DENSE_MIN_Q_LEN = 2048
# ... and at most this many in a step (each is its own launches, per layer).
DENSE_MAX_ROWS = 8
# A row of n tokens is attended as one of DENSE_BUCKETS_PER_OCTAVE lengths per power of two
# (the tokens after it, which its queries never see, padding it): cuDNN builds a graph for each
# new shape (60-70 ms on the H200), so every prompt length cannot have its own.
DENSE_BUCKETS_PER_OCTAVE = 8
DENSE_DTYPES = (torch.float16, torch.bfloat16)
DENSE_MAX_HEAD_DIM = 128


class DenseRefused(RuntimeError):
    """cuDNN refused a dense attention (a shape or version it does not serve, its workspace
    out of memory): the caller attends those rows another way."""


class DenseRow(NamedTuple):
    """A dense row: its first query token in the batch, its tokens, and the length it is
    attended at (`dense_length`)."""

    start: int
    n: int
    length: int


def dense_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN's fused attention serves this device (Ampere or newer, cuDNN present),
    dtype (16-bit floats) and head size (a multiple of 8, at most 128)."""
    if device.type != "cuda" or dtype not in DENSE_DTYPES:
        return False
    if not torch.backends.cudnn.is_available() or head_dim % 8 or head_dim > DENSE_MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def plan_dense_rows(inputs: AttentionInputs, min_q_len: int) -> list[DenseRow]:
    """The rows of a prefill batch that attend densely: at least `min_q_len` (DENSE_MIN_Q_LEN)
    query tokens and no cached prefix, as long as there are at most DENSE_MAX_ROWS of them
    (else none)."""
    rows, start = [], 0
    for q_len, kv_len in zip(inputs.query_lens_cpu, inputs.kv_lens_cpu, strict=True):
        if whole_prompt(q_len, kv_len, min_q_len):
            rows.append(DenseRow(start, q_len, dense_length(q_len)))
        start += q_len
    return rows if len(rows) <= DENSE_MAX_ROWS else []


def whole_prompt(q_len: int, kv_len: int, min_q_len: int) -> bool:
    """Whether a row of `q_len` query tokens and `kv_len` tokens of context is a whole prompt
    of at least `min_q_len` tokens (no cached prefix): a dense row, if its step has few."""
    return q_len >= min_q_len and kv_len == q_len


def spare_rows(rows: list[DenseRow], tokens: int) -> int:
    """How many rows past a step's `tokens` its dense `rows` read, padded."""
    return max([0, *(row.start + row.length - tokens for row in rows)])


def dense_length(n: int) -> int:
    """The length a row of `n` tokens is attended at: `n` rounded up to one of
    DENSE_BUCKETS_PER_OCTAVE steps of its power of two."""
    step = max(1, (1 << (n.bit_length() - 1)) // DENSE_BUCKETS_PER_OCTAVE)
    return -(-n // step) * step


def dense_lengths(min_len: int, max_len: int) -> list[int]:
    """Every length rows of `min_len` to `max_len` tokens are attended at (`dense_length`)."""
    return sorted({dense_length(n) for n in range(min_len, max_len + 1)})


def build_dense_graph(
    length: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, scale: float,
) -> None:  # fmt: skip
    """Have cuDNN build its graph for rows attended at `length` now (it keeps it per thread:
    call this on the thread that runs the steps): one call on zeros laid out as a step's, the
    graph's key being the shapes and strides."""
    q = torch.zeros(length, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(length, num_kv_heads, head_dim, dtype=dtype, device=device)
    window = _window(kv, 0, length)
    _causal(_window(q, 0, length), window, window, scale)


def dense_attend(
    rows: list[DenseRow],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Write into `out` the causal attention of each of `rows` over its own tokens: `q`
    `[T, Hq, D]`, the step's `k` / `v` `[T, Hkv, D]`, each with storage for the rows' padding
    past T (`spare_rows`; finite in K and V: keys a row's queries never see still meet a zero
    probability). Raises DenseRefused if cuDNN refuses a row (the rows before it written)."""
    end = max(row.start + row.length for row in rows)
    q_rows = (q.untyped_storage().nbytes() // q.element_size() - q.storage_offset()) // q[0].numel()
    if end > min(k.shape[0], v.shape[0], q_rows):
        raise ValueError(f"dense rows read {end} rows: K/V hold {k.shape[0]}, q {q_rows}")
    for start, n, length in rows:
        result = _causal(
            _window(q, start, length), _window(k, start, length), _window(v, start, length),
            scale,
        )  # fmt: skip
        out[start : start + n] = result[0, :, :n].transpose(0, 1)


def _window(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """Rows `start .. start + length` of `x` `[T, H, D]` (contiguous, possibly past T within
    its storage) as `[1, H, length, D]`."""
    _, h, d = x.shape
    offset = x.storage_offset() + start * h * d
    return x.as_strided((1, h, length, d), (length * h * d, d, h * d, 1), offset)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`_dense_causal`, its errors raised as DenseRefused."""
    try:
        return _dense_causal(q, k, v, scale)
    except RuntimeError as exc:
        raise DenseRefused(str(exc)) from exc


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """cuDNN's causal attention of `[1, Hq, n, D]` queries over `[1, Hkv, n, D]` keys and
    values (query head h reads KV head h // (Hq / Hkv))."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, 0.0, True, False, scale=scale
    )[0]
