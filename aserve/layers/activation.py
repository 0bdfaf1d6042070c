"""SiLU-and-mul: the gated activation of Llama-style MLPs, on a fused gate|up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aserve.layers.fused import FusedOps


def silu_and_mul(gate_up: torch.Tensor, ops: FusedOps | None = None) -> torch.Tensor:
    """`ops` (FlashInfer) does it in one kernel."""
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # Out of place: in place on the strided half ran 3x slower on CPU, and a contiguous
    # copy first cost 40 against 28 us at 16 rows (3.0 against 2.2 ms at 2,400).
    return F.silu(gate).mul_(up)
