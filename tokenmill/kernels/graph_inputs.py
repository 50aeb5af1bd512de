"""The first kernel of a decode CUDA graph: fills the graph's static input buffers from one
packed block of the step's inputs.

The host packs a step's inputs (`pack_decode_inputs`) and copies them with one host→device
copy into a static device block; this kernel, captured at the head of the graph, spreads them
into the buffers the model reads, takes each pending input token from the previous step's
samples (still on the device), and pads the rows beyond the batch. Without it a replay is
preceded by a copy per buffer, the padding fills and a gather: seven or more small operations.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import direct_launch
from tokenmill.kernels.pdl import pdl_options, pdl_wait

# The packed block: batch size B and page-table width W, then five arrays of `padded` entries
# (input ids, positions, slots, KV lengths, row of the previous step's samples or -1), then the
# page table, B x W.
_HEADER = 2
_ARRAYS = 5


@direct_launch
@triton.jit
def _decode_inputs_kernel(
    block_ptr, sampled_ptr, out_ids_ptr, out_pos_ptr, out_slots_ptr, out_kv_lens_ptr,
    out_table_ptr, padded, out_width, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    batch = tl.load(block_ptr)
    if row < batch:
        width = tl.load(block_ptr + 1)
        arrays = block_ptr + 2 + row
        token = tl.load(arrays)
        src = tl.load(arrays + 4 * padded)
        if src >= 0:  # the input token is the one the previous step sampled in row `src`
            token = tl.load(sampled_ptr + src)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_pos_ptr + row, tl.load(arrays + padded))
        tl.store(out_slots_ptr + row, tl.load(arrays + 2 * padded))
        tl.store(out_kv_lens_ptr + row, tl.load(arrays + 3 * padded))
        table = block_ptr + 2 + 5 * padded + row * width
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            pages = tl.load(table + cols, mask=cols < width)
            tl.store(out_table_ptr + row * out_width + cols, pages, mask=cols < width)
    else:  # padding: writes nothing, attends to nothing
        tl.store(out_slots_ptr + row, -1)
        tl.store(out_kv_lens_ptr + row, 0)


def decode_block_size(padded: int, max_pages: int) -> int:
    """Entries of the packed block for a graph of `padded` rows and page tables of up to
    `max_pages` pages."""
    return _HEADER + _ARRAYS * padded + padded * max_pages


def pack_decode_inputs(
    ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    kv_lens: np.ndarray,
    page_table: np.ndarray,
    row_src: np.ndarray,
    padded: int,
) -> np.ndarray:
    """A decode batch of B rows packed for a graph of `padded` rows (int64): row i's input id
    is the previous step's sample in row `row_src[i]` where that is >= 0."""
    batch, width = page_table.shape
    if batch > padded:
        raise ValueError(f"a batch of {batch} rows does not fit a graph of {padded} rows")
    block = np.zeros(_HEADER + _ARRAYS * padded + batch * width, dtype=np.int64)
    block[:_HEADER] = (batch, width)
    for i, values in enumerate((ids, positions, slots, kv_lens, row_src)):
        block[_HEADER + i * padded : _HEADER + i * padded + batch] = values
    block[_HEADER + _ARRAYS * padded :] = page_table.reshape(-1)
    return block


def fill_decode_inputs(
    block: torch.Tensor, sampled: torch.Tensor, static: tuple[torch.Tensor, ...], padded: int
) -> None:
    """Spread a packed block (`pack_decode_inputs`, on the device) into the first `padded` rows
    of the static buffers (input_ids, positions, slots, kv_lens, page_table), int64; the page
    table's width must hold the block's. Rows beyond the batch get slot -1 and KV length 0."""
    out_ids, out_pos, out_slots, out_kv_lens, out_table = static
    if padded > out_ids.shape[0] or not out_table.is_contiguous():
        raise ValueError(
            f"{padded} padded rows do not fit contiguous static buffers {tuple(out_table.shape)}"
        )
    _decode_inputs_kernel[(padded,)](
        block, sampled, out_ids, out_pos, out_slots, out_kv_lens, out_table, padded,
        out_table.shape[1], BLOCK_W=128, **pdl_options(block.device),
    )  # fmt: skip


# The packed verify block: rows B, page-table width W and tokens T; then five arrays of
# `padded_tokens` entries (input ids, positions, slots, entry of the previous step's samples or
# -1, entry of the drafts buffer or -1); then cu_query_lens (`padded_rows + 1` entries, T past
# the batch) and KV lengths (`padded_rows`, 0 past the batch); then the page table, B x W.
_VERIFY_HEADER = 3


@direct_launch
@triton.jit
def _verify_inputs_kernel(
    block_ptr, sampled_ptr, drafts_ptr, out_ids_ptr, out_pos_ptr, out_slots_ptr, out_cu_ptr,
    out_kv_lens_ptr, out_table_ptr, padded_tokens, padded_rows, out_width, BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    i = tl.program_id(0)
    batch = tl.load(block_ptr)
    num_tokens = tl.load(block_ptr + 2)
    tokens = block_ptr + 3 + i
    if i < num_tokens:
        token = tl.load(tokens)
        src = tl.load(tokens + 3 * padded_tokens)
        if src >= 0:  # sampled by the previous step, still on the device
            token = tl.load(sampled_ptr + src)
        draft = tl.load(tokens + 4 * padded_tokens)
        if draft >= 0:  # drafted on the device by the draft model
            token = tl.load(drafts_ptr + draft)
        tl.store(out_ids_ptr + i, token)
        tl.store(out_pos_ptr + i, tl.load(tokens + padded_tokens))
        tl.store(out_slots_ptr + i, tl.load(tokens + 2 * padded_tokens))
    else:  # padding: position 0, writes no KV, belongs to no row
        tl.store(out_ids_ptr + i, 0)
        tl.store(out_pos_ptr + i, 0)
        tl.store(out_slots_ptr + i, -1)
    rows = block_ptr + 3 + 5 * padded_tokens
    if i <= padded_rows:
        tl.store(out_cu_ptr + i, tl.load(rows + i))
    if i < padded_rows:
        tl.store(out_kv_lens_ptr + i, tl.load(rows + padded_rows + 1 + i))
    if i < batch:
        width = tl.load(block_ptr + 1)
        table = rows + 2 * padded_rows + 1 + i * width
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            pages = tl.load(table + cols, mask=cols < width)
            tl.store(out_table_ptr + i * out_width + cols, pages, mask=cols < width)


def verify_block_size(padded_rows: int, padded_tokens: int, max_pages: int) -> int:
    """Entries of the packed verify block for a graph of `padded_rows` rows and
    `padded_tokens` tokens, page tables of up to `max_pages` pages."""
    return _VERIFY_HEADER + 5 * padded_tokens + 2 * padded_rows + 1 + padded_rows * max_pages


def pack_verify_inputs(
    ids: np.ndarray,
    positions: np.ndarray,
    slots: np.ndarray,
    query_lens: np.ndarray,
    kv_lens: np.ndarray,
    page_table: np.ndarray,
    input_src: np.ndarray,
    draft_src: np.ndarray,
    padded_rows: int,
    padded_tokens: int,
) -> np.ndarray:
    """A batch of B rows with `query_lens` tokens each (T in all) packed for a graph of
    `padded_rows` rows and `padded_tokens` tokens (int64): token t's input id is entry
    `input_src[t]` of the previous step's samples, or entry `draft_src[t]` of the drafts buffer,
    where those are >= 0."""
    batch, width = page_table.shape
    num_tokens = len(ids)
    if batch > padded_rows or num_tokens > padded_tokens:
        raise ValueError(
            f"a batch of {batch} rows and {num_tokens} tokens does not fit a graph of "
            f"{padded_rows} rows and {padded_tokens} tokens"
        )
    block = np.zeros(_VERIFY_HEADER + 5 * padded_tokens + 2 * padded_rows + 1 + batch * width,
                     dtype=np.int64)  # fmt: skip
    block[:_VERIFY_HEADER] = (batch, width, num_tokens)
    at = _VERIFY_HEADER
    for values in (ids, positions, slots, input_src, draft_src):
        block[at : at + num_tokens] = values
        at += padded_tokens
    block[at + 1 : at + 1 + batch] = np.cumsum(query_lens)
    block[at + 1 + batch : at + padded_rows + 1] = num_tokens
    at += padded_rows + 1
    block[at : at + batch] = kv_lens
    block[at + padded_rows :] = page_table.reshape(-1)
    return block


def fill_verify_inputs(
    block: torch.Tensor,
    sampled: torch.Tensor,
    drafts: torch.Tensor,
    static: tuple[torch.Tensor, ...],
    padded_rows: int,
    padded_tokens: int,
) -> None:
    """Spread a packed verify block (`pack_verify_inputs`, on the device) into the static
    buffers (input_ids, positions, slots, cu_query_lens, kv_lens, page_table), int64. Tokens
    past the batch get position 0 and slot -1; rows past it no tokens and KV length 0."""
    out_ids, out_pos, out_slots, out_cu, out_kv_lens, out_table = static
    if (
        padded_tokens > out_ids.shape[0]
        or padded_rows >= out_cu.shape[0]
        or padded_tokens <= padded_rows
        or not out_table.is_contiguous()
    ):
        raise ValueError(
            f"{padded_rows} rows of {padded_tokens} tokens do not fit the static buffers"
        )
    _verify_inputs_kernel[(padded_tokens,)](
        block, sampled, drafts, out_ids, out_pos, out_slots, out_cu, out_kv_lens, out_table,
        padded_tokens, padded_rows, out_table.shape[1], BLOCK_W=128, **pdl_options(block.device),
    )  # fmt: skip
