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

from tokenmill.kernels.pdl import pdl_options, pdl_wait

# The packed block: batch size B and page-table width W, then five arrays of `padded` entries
# (input ids, positions, slots, KV lengths, row of the previous step's samples or -1), then the
# page table, B x W.
_HEADER = 2
_ARRAYS = 5


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
