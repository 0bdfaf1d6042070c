"""Quantized weights on CUDA: a Triton weight-only GEMM that reads the codes as they are.

The weight keeps its integer codes (4-bit two to a byte, or 8-bit) with float32 scales and
offsets per group of 32 inputs, as on CPU (quant/codes.py); nothing is de-quantized to
bfloat16 in memory. Each group's products are one tensor-core dot of the activations with
the codes (small integers, exact in bfloat16), accumulated in float32, then scaled and offset
once per group, `y += part * scale + sum(x over the group) * offset`: the weights enter the
product exactly as the file holds them. Triton is imported on first use.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from aserve.quant.codes import Codes, groups_of_at_most_32

GROUPS = (16, 32)


@cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantized_gemm(
        x_ptr,
        codes_ptr,
        scales_ptr,
        offsets_ptr,
        y_ptr,
        M,
        N,
        K,
        FOUR_BIT: tl.constexpr,
        GROUP: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, GROUP)
        row_ok = rows < M
        col_ok = cols < N
        groups = K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, groups):
            k = g * GROUP + ks
            x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None], other=0.0)
            if FOUR_BIT:
                # byte j of a row holds input 2j in its low nibble and 2j + 1 in its high one
                packed = tl.load(
                    codes_ptr + cols[None, :] * (K // 2) + (k[:, None] // 2),
                    mask=col_ok[None, :],
                    other=0,
                )
                code = (packed >> ((k[:, None] % 2) * 4)) & 15
            else:
                code = tl.load(
                    codes_ptr + cols[None, :] * K + k[:, None], mask=col_ok[None, :], other=0
                )
            part = tl.dot(x, code.to(x.dtype), input_precision=PRECISION)
            scale = tl.load(scales_ptr + cols * groups + g, mask=col_ok, other=0.0)
            offset = tl.load(offsets_ptr + cols * groups + g, mask=col_ok, other=0.0)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            acc += part * scale[None, :] + x_sum[:, None] * offset[None, :]
        tl.store(
            y_ptr + rows[:, None] * N + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )

    return quantized_gemm


class CudaWeight:
    """A `[rows, cols]` weight on CUDA in groups of 16 or 32 inputs: 4-bit codes two to a
    byte, or codes of up to 8 bits as int8 (the offset takes the shift by 128)."""

    def __init__(self, codes: Codes, device: torch.device) -> None:
        codes = groups_of_at_most_32(codes)
        if codes.group not in GROUPS or codes.bits > 8:
            raise ValueError(f"CUDA products take groups of {GROUPS} and up to 8 bits")
        self.shape = codes.shape
        self.group = codes.group
        self.four_bit = codes.bits <= 4 and codes.group == 32
        if self.four_bit:
            values, offsets = codes.codes.to(device), codes.offsets
            self.codes = values[:, 0::2] | (values[:, 1::2] << 4)
        else:
            signed, offsets = codes.signed()
            self.codes = signed.to(device)
        self.scales = codes.scales.to(device, torch.float32).contiguous()
        self.offsets = offsets.to(device, torch.float32).contiguous()

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        m, k = rows.shape
        n = self.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        # Few rows: narrow column tiles, so that more programs share the weight reads.
        block_m, block_n, stages = (16, 32, 4) if m <= 16 else (64, 128, 3)
        grid = ((m + block_m - 1) // block_m, (n + block_n - 1) // block_n)
        _kernel()[grid](
            rows,
            self.codes,
            self.scales,
            self.offsets,
            y,
            m,
            n,
            k,
            FOUR_BIT=self.four_bit,
            GROUP=self.group,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_stages=stages,
        )
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], n)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized, in float32 (embedding lookups)."""
        codes = self.codes[ids]
        if self.four_bit:
            values = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).float()
        else:
            values = codes.float()
        grouped = values.view(len(ids), -1, self.group)
        out = grouped * self.scales[ids][..., None] + self.offsets[ids][..., None]
        return out.view(len(ids), -1)
