"""Arrival tickets for kernels whose last program to finish reduces the others' partial results.

One zeroed int32 buffer per device, shared by every such kernel: a launch takes tickets with an
atomic add and the reducing program sets its ticket back to zero, so the buffer is all zeros
between launches (kernels on one stream run one after another, also inside CUDA graphs).
"""

from __future__ import annotations

import torch

NUM_TICKETS = 1 << 16

_buffers: dict[torch.device, torch.Tensor] = {}


def ticket_buffer(device: torch.device, needed: int) -> torch.Tensor:
    """The device's ticket buffer; `needed` tickets must fit in it."""
    if needed > NUM_TICKETS:
        raise ValueError(f"a launch needs {needed} tickets, more than the {NUM_TICKETS} there are")
    if device not in _buffers:
        _buffers[device] = torch.zeros(NUM_TICKETS, dtype=torch.int32, device=device)
    return _buffers[device]
