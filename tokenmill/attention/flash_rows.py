"""A prefill batch's long rows through flash attention (torch's `_flash_attention_forward`,
FlashAttention's varlen kernel): their contexts gathered from the paged K/V cache into
contiguous K and V, one launch for every long row.

The Triton prefill kernel reads paged K/V at about half of flash attention's rate on long
prompts (docs/perf-notes.md); gathering a row's context costs one read and one write of its
K/V, a small part of the attention's time when the row has many query tokens for each context
token, so a step takes this path only where that holds (`plan_flash_rows`). Short rows (decodes,
verifies, short chunks) stay in the Triton kernel's launch of their own.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.attention.backend import AttentionInputs

# A step's long rows go through flash attention when they have at least this many query
# tokens in all (fewer: a launch and the gathers cost more than they gain) ...
FLASH_MIN_TOKENS = 2048
# ... and their contexts at most this many tokens per query token (each context token is
# gathered once: 4 keeps the gather under ~2% of the attention's FLOP time) ...
FLASH_MAX_CONTEXT_PER_QUERY = 4
# ... and the gathered K and V take at most this many bytes (memory outside the KV pool).
FLASH_MAX_GATHER_BYTES = 1 << 30
FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


class FlashRows(NamedTuple):
    """A step's long rows as flash attention takes them: their query tokens in the batch (a
    slice when they are one run of rows), the cache slots of their contexts row after row, the
    cumulative query and context lengths (int32) and the longest of each."""

    queries: slice | torch.Tensor
    slots: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash attention serves this device, K/V dtype and head size (Ampere or newer,
    16-bit floats, head_dim a multiple of 8 up to 256)."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return False
    if head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


def plan_flash_rows(
    inputs: AttentionInputs, short_q_len: int, page_size: int, token_bytes: int
) -> FlashRows | None:
    """The rows of more than `short_q_len` query tokens of a prefill batch, as `FlashRows`,
    when flash attention pays for them (see the FLASH_* bounds; `token_bytes`: one context
    token's K and V in one layer); else None. Everything is computed on the device, from
    sizes the host knows: no host-device synchronisation."""
    lens, kv_lens = inputs.query_lens_cpu, inputs.kv_lens_cpu
    long = [i for i, q in enumerate(lens) if q > short_q_len]
    q_tokens = sum(lens[i] for i in long)
    context = sum(kv_lens[i] for i in long)
    if q_tokens < FLASH_MIN_TOKENS or context > FLASH_MAX_CONTEXT_PER_QUERY * q_tokens:
        return None
    if context * token_bytes > FLASH_MAX_GATHER_BYTES:
        return None
    device = inputs.kv_lens.device
    q_lens = inputs.cu_query_lens[1:] - inputs.cu_query_lens[:-1]
    queries: slice | torch.Tensor
    if long == list(range(long[0], long[-1] + 1)):  # one run of rows: their tokens are too
        rows = torch.arange(long[0], long[-1] + 1, device=device)
        first = sum(lens[: long[0]])
        queries = slice(first, first + q_tokens)
    else:  # the long rows in order (a stable sort puts them first)
        rows = torch.argsort((q_lens <= short_q_len).to(torch.int8), stable=True)[: len(long)]
        row_of, offsets = _ranges(q_lens[rows], q_tokens)
        queries = inputs.cu_query_lens[rows][row_of] + offsets
    row_kv = inputs.kv_lens[rows].to(torch.int64)
    row_of, positions = _ranges(row_kv, context)
    pages = inputs.page_table[rows[row_of], positions // page_size].to(torch.int64)
    return FlashRows(
        queries=queries,
        slots=pages * page_size + positions % page_size,
        cu_q=_cumulative(q_lens[rows]),
        cu_k=_cumulative(row_kv),
        max_q=max(lens[i] for i in long),
        max_k=max(kv_lens[i] for i in long),
    )


def _ranges(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For `lengths` summing to `total` (known on the host): each of the `total` entries' index
    in `lengths` and offset `0 .. lengths[i] - 1` within it."""
    index = torch.arange(lengths.shape[0], device=lengths.device)
    row = torch.repeat_interleave(index, lengths, output_size=total)
    starts = torch.cumsum(lengths, 0) - lengths
    return row, torch.arange(total, device=lengths.device) - starts[row]


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """`[0, l0, l0 + l1, ...]` as int32 (flash attention's sequence boundaries)."""
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def flash_attend(
    rows: FlashRows,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int | None,
) -> None:
    """Write into `out` the causal attention of `rows`' query tokens of `q` `[T, Hq, D]` over
    their contexts in `k_cache` / `v_cache` `[slots, Hkv, D]` (each row's queries are its
    last tokens; `window`: keys more than `window - 1` positions back are not seen)."""
    k = k_cache.index_select(0, rows.slots)
    v = v_cache.index_select(0, rows.slots)
    out[rows.queries] = _flash_varlen(q[rows.queries], k, v, rows, scale, window)


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: FlashRows,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """FlashAttention's causal varlen forward (sequences by `rows.cu_q` / `rows.cu_k`, each
    query row aligned with its context's end; grouped heads when k and v have fewer)."""
    left, right = (window - 1, 0) if window is not None else (None, None)
    return torch.ops.aten._flash_attention_forward(
        q, k, v, rows.cu_q, rows.cu_k, rows.max_q, rows.max_k, 0.0, True, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )[0]  # fmt: skip
