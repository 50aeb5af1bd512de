"""One launch that fills a decode CUDA graph's static input buffers from a step's inputs.

Without it a replay is preceded by a copy per buffer, the padding fills and the gather of the
tokens the previous step sampled on the device: seven or more small operations whose GPU time
(a few µs each) adds to every decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.pdl import pdl_options, pdl_wait


# Batch size and page-table width change from step to step: not specialised on (a value of 1 or
# a multiple of 16 would otherwise compile a new variant in the middle of serving).
@triton.jit(do_not_specialize=["batch", "width"])
def _decode_inputs_kernel(
    ids_ptr, pos_ptr, slots_ptr, kv_lens_ptr, table_ptr, row_src_ptr, sampled_ptr,
    out_ids_ptr, out_pos_ptr, out_slots_ptr, out_kv_lens_ptr, out_table_ptr,
    batch, width, out_width, BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    if row < batch:
        src = tl.load(row_src_ptr + row)
        token = tl.load(ids_ptr + row)
        if src >= 0:  # the input token is the one the previous step sampled in row `src`
            token = tl.load(sampled_ptr + src)
        tl.store(out_ids_ptr + row, token)
        tl.store(out_pos_ptr + row, tl.load(pos_ptr + row))
        tl.store(out_slots_ptr + row, tl.load(slots_ptr + row))
        tl.store(out_kv_lens_ptr + row, tl.load(kv_lens_ptr + row))
        for start in range(0, width, BLOCK_W):
            cols = start + tl.arange(0, BLOCK_W)
            pages = tl.load(table_ptr + row * width + cols, mask=cols < width)
            tl.store(out_table_ptr + row * out_width + cols, pages, mask=cols < width)
    else:  # padding: writes nothing, attends to nothing
        tl.store(out_slots_ptr + row, -1)
        tl.store(out_kv_lens_ptr + row, 0)


def fill_decode_inputs(
    inputs: tuple[torch.Tensor, ...],
    row_src: torch.Tensor,
    sampled: torch.Tensor,
    static: tuple[torch.Tensor, ...],
    padded: int,
) -> None:
    """Copy a decode batch of B rows into the first `padded` rows of the static buffers.

    `inputs` and `static` are (input_ids, positions, slots, kv_lens, page_table), int64; the
    inputs have B rows (page table `[B, W]`), the static ones at least `padded` (page table
    `[>= padded, >= W]`). Row i's input id is `sampled[row_src[i]]` where `row_src[i] >= 0`.
    Rows B..padded-1 get slot -1 and KV length 0.
    """
    ids, positions, slots, kv_lens, table = inputs
    out_ids, out_pos, out_slots, out_kv_lens, out_table = static
    batch, width = table.shape
    if not (batch <= padded <= out_ids.shape[0] and width <= out_table.shape[1]):
        raise ValueError(
            f"a batch of {batch} rows x {width} pages does not fit {padded} padded rows of "
            f"static buffers {tuple(out_table.shape)}"
        )
    if not (table.is_contiguous() and out_table.is_contiguous()):
        raise ValueError("fill_decode_inputs needs contiguous page tables")
    _decode_inputs_kernel[(padded,)](
        ids, positions, slots, kv_lens, table, row_src, sampled,
        out_ids, out_pos, out_slots, out_kv_lens, out_table,
        batch, width, out_table.shape[1], BLOCK_W=128, **pdl_options(ids.device),
    )  # fmt: skip
