"""Tickets of split kernels: the last program of a split's parts finishes the work itself, so
no second kernel is launched to combine them (CUDA only: it imports Triton).

A kernel that splits a piece of work (an output tile over K, an attention context over its
tokens) stores each split's partial result, then takes a ticket: an atomic count per piece in
one buffer per device. The program that draws the last ticket sets the count back to 0 for
the next launch and combines the parts, in split order (the same result whichever program is
last). Kernels of a stream run one after another, so they share the buffer. At one row every
kernel of a decode step is a link of a chain of a few hundred; a kernel fewer is a link fewer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TICKET_SLOTS = 1 << 16
_tickets: dict[torch.device, torch.Tensor] = {}


def split_tickets(device: torch.device, pieces: int = 0) -> torch.Tensor:
    """The device's tickets, one int32 per piece of split work, zero between launches. Take
    them first outside a CUDA graph's capture, so that no capture allocates them."""
    assert pieces <= TICKET_SLOTS, f"a split kernel of {pieces} pieces"
    if device.type == "cuda" and device.index is None:  # "cuda" and a tensor's "cuda:0" alike
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _tickets:
        _tickets[device] = torch.zeros(TICKET_SLOTS, dtype=torch.int32, device=device)
    return _tickets[device]


@triton.jit
def last_of_splits(tickets, piece, splits):
    """Called by each of a piece's `splits` programs once its part is stored: whether this
    program is the last of them to get here, in which case the piece's ticket is set back to
    0 (every other program has taken its own). That one then reads the parts from L2 (loads
    with `.cg`: other SMs wrote them)."""
    tl.debug_barrier()  # every thread's part stored before the ticket is taken
    last = tl.atomic_add(tickets + piece, 1, sem="acq_rel") == splits - 1
    if last:
        tl.store(tickets + piece, 0)
    return last
