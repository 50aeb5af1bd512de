"""Greedy sampling: each row's argmax over the vocabulary in one launch.

`torch.argmax` reduces a `[1, 152k]` row with few programs (~13 µs on an H200, a sixtieth of a
qwen3-0.6b decode step). Here a grid of (rows x vocabulary chunks) programs each find their
chunk's maximum; the last program of a row to finish (an arrival ticket, as in the split-K GEMV)
picks the winner among the chunks. Ties go to the lowest index, as in `torch.argmax`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launch import cdiv, direct_launch, next_power_of_2
from tokenmill.kernels.pdl import pdl_options, pdl_wait
from tokenmill.kernels.tickets import last_to_arrive, reset_ticket, ticket_buffer

BLOCK = 2048  # vocabulary entries per program


@direct_launch
@triton.jit
def _argmax_kernel(
    logits_ptr, tokens_ptr, host_ptr, part_val_ptr, part_idx_ptr, ticket_ptr, vocab, stride_row,
    CHUNKS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, TO_HOST: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32)  # fmt: skip
    best = tl.max(x, axis=0)
    index = chunk * BLOCK + tl.argmax(x, axis=0, tie_break_left=True)
    tl.store(part_val_ptr + row * CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * CHUNKS + chunk, index)
    if last_to_arrive(ticket_ptr, row, CHUNKS):
        c = tl.arange(0, BLOCK_C)
        mask = c < CHUNKS
        vals = tl.load(part_val_ptr + row * CHUNKS + c, mask=mask, other=float("-inf"),
                       cache_modifier=".cg")  # fmt: skip
        idxs = tl.load(part_idx_ptr + row * CHUNKS + c, mask=mask, other=0, cache_modifier=".cg")
        top = tl.max(vals, axis=0)
        winner = tl.min(tl.where(mask & (vals == top), idxs, vocab), axis=0)
        tl.store(tokens_ptr + row, winner.to(tl.int64))
        if TO_HOST:  # pinned host memory, mapped: no device-to-host copy after the kernel
            tl.store(host_ptr + row, winner.to(tl.int64))
        reset_ticket(ticket_ptr, row)


def argmax_rows(
    logits: torch.Tensor, host_out: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (int64) of a 2-D `[rows, vocab]` tensor, contiguous along vocab,
    written to `out` (a new tensor if None) and returned.

    With `host_out` (int64 `[rows]` in pinned host memory) the kernel also writes the tokens
    there, readable once the kernel is done, so the host needs no separate copy. Rows whose
    maximum is NaN are not defined (torch returns the NaN's index)."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"argmax_rows takes [rows, vocab] contiguous rows, got {logits.shape}")
    rows, vocab = logits.shape
    chunks = cdiv(vocab, BLOCK)
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    for name, t in (("out", out), ("host_out", host_out)):
        if t is not None and (t.shape != (rows,) or t.dtype != torch.int64):
            raise ValueError(f"{name} must be int64 [{rows}], got {t.dtype} {tuple(t.shape)}")
    if rows == 0:
        return out
    part_val = torch.empty((rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((rows, chunks), dtype=torch.int32, device=logits.device)
    _argmax_kernel[(rows, chunks)](
        logits, out, host_out if host_out is not None else out, part_val, part_idx,
        ticket_buffer(logits.device, rows), vocab, logits.stride(0), CHUNKS=chunks, BLOCK=BLOCK,
        BLOCK_C=next_power_of_2(chunks), TO_HOST=host_out is not None,
        **pdl_options(logits.device),
    )  # fmt: skip
    return out
