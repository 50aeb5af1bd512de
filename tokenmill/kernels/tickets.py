"""Arrival tickets for kernels whose last program to finish reduces the others' partial results.

One zeroed int32 buffer per device, shared by every such kernel: a launch takes tickets with an
atomic add and the reducing program sets its ticket back to zero, so the buffer is all zeros
between launches (kernels on one stream run one after another, also inside CUDA graphs). In a
kernel: each program stores its partial result, then `last_to_arrive`; the one program for which
it is true reads the partials (`.cg` loads: past L1, which may hold stale lines) and ends with
`reset_ticket`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_TICKETS = 1 << 16

_buffers: dict[torch.device, torch.Tensor] = {}


def ticket_buffer(device: torch.device, needed: int) -> torch.Tensor:
    """The device's ticket buffer; `needed` tickets must fit in it."""
    if needed > NUM_TICKETS:
        raise ValueError(f"a launch needs {needed} tickets, more than the {NUM_TICKETS} there are")
    if device not in _buffers:
        _buffers[device] = torch.zeros(NUM_TICKETS, dtype=torch.int32, device=device)
    return _buffers[device]


@triton.jit
def last_to_arrive(ticket_ptr, index, arrivals):
    """Take ticket `index` after this program's partial is stored: true for the last of the
    `arrivals` programs sharing it (the atomic's acquire-release makes the others' partials
    visible to it)."""
    tl.debug_barrier()  # every thread's partial is written before the ticket is taken
    return tl.atomic_add(ticket_ptr + index, 1, sem="acq_rel") == arrivals - 1


@triton.jit
def reset_ticket(ticket_ptr, index):
    """The last program's final step: ticket `index` back to zero for the next launch."""
    tl.atomic_xchg(ticket_ptr + index, 0)
