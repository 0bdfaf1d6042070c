"""Quantized GGUF weights: every block format decoded bit for bit as the `gguf` package
de-quantizes it, products against the float32 de-quantized reference, tiny GGUF models of
each format through `aserve.LLM`, the embedded model against its float32 path, and bad files
refused in one line; float checkpoints quantized at load (`--quantization int8|int4`)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from aserve import LLM, SamplingParams
from aserve.config import PLAIN_EXPERTS, ExpertStyle, RouterStyle
from aserve.engine import engine as engine_module
from aserve.layers.moe import activate, grouped_experts, route, route_deepseek
from aserve.quant import iquants
from aserve.quant import native as native_module
from aserve.quant.codes import Codes, quantize
from aserve.quant.gguf import BLOCKS, QuantizedTensor, decode
from aserve.quant.method import ProductGroup
from aserve.quant.native import (
    BLAS_ROWS,
    LANES,
    NEVER,
    ExpertStack,
    FloatWeight,
    NativeWeight,
    Scratch,
    build_kind,
    in_blocks,
    linear_group,
    moe_layer,
    native_kernels,
    one_format,
    out_of_blocks,
)
from tests.test_cpu_ops import other_build_attention_operands
from tests.tiny_models import make_tiny_model

# Byte offsets of each format's float16 fields: random bytes elsewhere are valid codes.
HALVES = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
    QType.IQ1_S: (0,),
    QType.IQ1_M: (),  # its float16 is four nibbles atop its scales: see `random_blocks`
    QType.IQ2_XXS: (0,),
    QType.IQ2_XS: (0,),
    QType.IQ2_S: (0,),
    QType.IQ3_XXS: (0,),
    QType.IQ3_S: (0,),
    QType.MXFP4: (),  # an exponent byte: see `random_blocks`
}
FORMATS = list(BLOCKS)


def random_blocks(qtype: QType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A valid `[rows, bytes]` tensor of `qtype`: random codes, small float16 scales."""
    rng = np.random.default_rng(seed)
    size, nbytes = BLOCKS[qtype]
    raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for at in HALVES[qtype]:
        halves = rng.uniform(-0.05, 0.05, (rows, cols // size)).astype(np.float16)
        raw[..., at : at + 2] = halves[..., None].view(np.uint8)
    if qtype == QType.MXFP4:  # scales 2^-10 to 2^1
        raw[..., 0] = rng.integers(117, 129, (rows, cols // size), dtype=np.uint8)
    if qtype == QType.IQ1_M:  # the float16's nibbles, low first, atop four 16-bit fields
        half = rng.uniform(-0.05, 0.05, (rows, cols // size, 1)).astype(np.float16)
        nibbles = (half.view(np.uint16) >> np.array([0, 4, 8, 12], np.uint16)) & 15
        fields = raw[..., 48:56].copy().view(np.uint16) & 0x0FFF | nibbles << 12
        raw[..., 48:56] = fields.view(np.uint8)
    return raw.reshape(rows, -1)


def test_every_format_has_its_half_offsets_listed() -> None:
    assert set(HALVES) == set(BLOCKS)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_decoding_is_gguf_dequantization_bit_for_bit(qtype: QType) -> None:
    raw = random_blocks(qtype, 6, 512)
    reference = gguf.quants.dequantize(raw, qtype).reshape(6, 512)
    codes = decode(torch.from_numpy(raw), qtype, 512)
    assert int(codes.codes.max()) < 2**codes.bits
    np.testing.assert_array_equal(codes.dequantize().numpy(), reference)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_rows_and_block_aligned_columns_keep_their_values(qtype: QType) -> None:
    size, _ = BLOCKS[qtype]
    tensor = QuantizedTensor(torch.from_numpy(random_blocks(qtype, 8, 2 * 256)), qtype, 512)
    full = tensor.decode().dequantize()
    torch.testing.assert_close(tensor[2:5].decode().dequantize(), full[2:5], rtol=0, atol=0)
    right = tensor[:, 256:512].decode().dequantize()
    torch.testing.assert_close(right, full[:, 256:512], rtol=0, atol=0)
    order = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    permuted = tensor.permute_rows(order).decode().dequantize()
    torch.testing.assert_close(permuted, full[order], rtol=0, atol=0)
    if size < 256:
        with pytest.raises(ValueError, match="split"):
            tensor[:, size // 2 :]


needs_kernels = pytest.mark.skipif(
    not native_kernels(), reason="aserve's CPU kernels did not build (no C++ compiler here)"
)


BLAS_FROM = min(BLAS_ROWS)
"""The fewest rows any CPU and format sends to BLAS (`native.blas_rows`)."""


@pytest.fixture
def blas_from_128(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products of BLAS_FROM rows and more, of weights made after it, through BLAS, whichever
    path this CPU chose for their format."""
    monkeypatch.setattr(native_module, "blas_rows", lambda weight: BLAS_FROM)


def as_the_kernels_round(x: torch.Tensor, weight: NativeWeight) -> torch.Tensor:
    """`x` in float64 as the CPU kernels multiply it by `weight`'s codes: where they round
    activations (`rounds_activations`), each block of 32 inputs of a row to integer steps of
    its largest magnitude / 32,639, in float32 as they compute it; else as it is."""
    if not weight.rounds_activations():
        return x.double()
    rows, cols = x.shape
    blocks = F.pad(x, (0, -cols % 32)).view(rows, -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 32639.0 / largest, torch.zeros_like(largest))
    steps = torch.round(blocks * inverse)
    return (steps.double() * (largest / 32639.0).double()).view(rows, -1)[:, :cols]


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_products_match_the_dequantized_weight(
    qtype: QType, monkeypatch: pytest.MonkeyPatch, blas_from_128: None
) -> None:
    """Against the float64 product of the de-quantized weight within float32 rounding (with
    the activations as the kernels round them), on the kernels (few rows) and on BLAS over
    de-quantized slices (many rows, also several slices); on the kernels a row's result
    bit-identical alone and in batches of every tile shape (rows 1 to 9 and past the 64-row
    block); lookups return the weight's own rows. 100 output features: the last panel of 8 is
    padded."""
    raw = torch.from_numpy(random_blocks(qtype, 100, 512, seed=1))
    codes = decode(raw, qtype, 512)
    weight = codes.dequantize()
    native = NativeWeight(codes)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BLAS_FROM + 20, 512, generator=generator)
    exact = F.linear(x.double(), weight.double())
    tolerance = 1e-5 * float(exact.abs().max())
    kernels = native.linear(x[:70], None)
    assert kernels.shape == (70, 100)
    rounded = F.linear(as_the_kernels_round(x[:70], native), weight.double())
    torch.testing.assert_close(kernels.double(), rounded, rtol=0, atol=tolerance)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        assert torch.equal(native.linear(x[3 : 3 + rows], None), kernels[3 : 3 + rows]), rows
    as_blas_takes_them = F.linear(as_the_kernels_round(x, native), weight.double())
    torch.testing.assert_close(
        native.linear(x, None).double(), as_blas_takes_them, rtol=0, atol=tolerance
    )
    monkeypatch.setattr(native_module, "BLAS_WHOLE_BYTES", 0)  # in slices of 3 panels
    monkeypatch.setattr(native_module, "BLAS_SLICE_BYTES", 3 * 8 * 4 * 512)
    torch.testing.assert_close(
        native.linear(x, None).double(), as_blas_takes_them, rtol=0, atol=tolerance
    )
    ids = torch.tensor([5, 0, 99, 5])
    torch.testing.assert_close(native.rows(ids), weight[ids], rtol=1e-6, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    ("qtype", "dtype", "offsets"),
    [
        (QType.Q4_1, torch.float16, True),
        (QType.Q8_0, torch.float16, False),
        (QType.Q4_K, torch.int8, True),
        (QType.Q6_K, torch.int8, False),
        (QType.IQ4_XS, torch.int8, False),
    ],
    ids=["Q4_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS"],
)
def test_scales_take_the_fewest_bytes_that_keep_them(
    qtype: QType,
    dtype: torch.dtype,
    offsets: bool,
    monkeypatch: pytest.MonkeyPatch,
    blas_from_128: None,
) -> None:
    """GGUF's float16 scales stay float16 and Q8_0's zero offsets are not stored; K-quants'
    and IQ4_XS's (a float16 times a small integer a group) are kept as int8 steps of the
    file's float16 base a block of 256 inputs (steps whose bases are not float16 are not
    taken). Products of every path and lookups are bit for bit those of the weight kept in
    float32."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 64, 512, seed=7)), qtype, 512)
    compact = NativeWeight(codes)
    assert compact.scales.dtype == dtype
    assert (compact.offsets.numel() > 0) == offsets
    assert compact.bases.numel() == (0 if dtype == torch.float16 else 64 * 2 * 2)
    if codes.steps is not None:
        assert compact.bases.dtype == torch.float16
        off_half = codes.steps._replace(scale_bases=codes.steps.scale_bases * (1 + 2**-20))
        assert native_module.panel_steps(off_half, codes.offsets, 64 // native_module.LANES) is None
    monkeypatch.setattr(native_module, "compact_scales", lambda scales, offsets: (scales, offsets))
    monkeypatch.setattr(native_module, "panel_steps", lambda steps, offsets, panels: None)
    wide = NativeWeight(codes)
    assert wide.scales.dtype == torch.float32 and wide.offsets.numel() > 0
    assert compact.nbytes < wide.nbytes
    x = torch.randn(BLAS_FROM + 3, 512, generator=torch.Generator().manual_seed(8))
    for rows in (1, 2, 5, 20, BLAS_FROM + 3):
        assert torch.equal(compact.linear(x[:rows], None), wide.linear(x[:rows], None)), rows
    ids = torch.tensor([0, 63, 17])
    assert torch.equal(compact.rows(ids), wide.rows(ids))


def check_through_row_changes(codes: Codes, check: Callable[[Codes], None]) -> None:
    """`check` of the codes, of each part of a split, padded, and after both joins."""
    check(codes)
    for part in codes.split_rows(3):
        check(part)
    check(codes.pad_rows(16))
    check(Codes.concat_rows(codes.split_rows(2)))
    check(codes.interleave_blocks(codes, 2))


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_super_block_formats_decode_their_scales_as_steps_of_a_base(qtype: QType) -> None:
    """Formats of 256-input blocks (K-quants, IQ4_XS, the codebook formats) give each group's
    scale (and offset, where stored as such) as an int8 step of its block's float16 base:
    step times base is the scale exactly, and the steps follow the rows through padding,
    splits and joins. Other formats give none."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 12, 512, seed=5)), qtype, 512)
    assert (codes.steps is not None) == (BLOCKS[qtype][0] == 256)
    if codes.steps is None:
        return

    def rebuilt(steps: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
        return steps.float() * bases.repeat_interleave(steps.shape[1] // bases.shape[1], 1)

    def check(c: Codes) -> None:
        assert c.steps is not None and c.steps.scale_steps.dtype == torch.int8
        assert torch.equal(rebuilt(c.steps.scale_steps, c.steps.scale_bases), c.scales)
        if c.steps.offset_steps is not None:
            assert c.steps.offset_bases is not None
            assert torch.equal(rebuilt(c.steps.offset_steps, c.steps.offset_bases), c.offsets)
        else:  # none at all, or stored as a multiple of the scale
            assert qtype in (QType.Q3_K, QType.Q6_K) or not c.offsets.any()

    check_through_row_changes(codes, check)


@pytest.mark.parametrize("qtype", [QType.Q2_K, QType.Q3_K], ids=lambda q: q.name)
@pytest.mark.parametrize("in_registers", [True, False], ids=["three-bits", "nibbles"])
def test_codes_of_two_and_three_bits_keep_three_bits_where_widened_in_registers(
    qtype: QType, in_registers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q2_K and Q3_K (groups of 16) keep three bits a code on CPU where the kernels widen them
    in registers, else a nibble: 100 rows pad to 104; an int8 step a group of 16 for the
    scale, and for Q2_K's offset (Q3_K's is -4 times its scale: centred, none stored), with
    two float16 bases a block of 256 inputs and lane."""
    monkeypatch.setattr(native_module, "keeps_three_bits", lambda: in_registers)
    codes = decode(torch.from_numpy(random_blocks(qtype, 100, 512)), qtype, 512)
    assert (codes.group, codes.bits) == (16, 2 if qtype == QType.Q2_K else 3)
    native = NativeWeight(codes)
    assert native.code_bits == (3 if in_registers else 4)
    code_bytes = 104 * 512 * native.code_bits // 8
    assert native.words.nbytes == code_bytes
    steps = 2 if qtype == QType.Q2_K else 1
    assert native.nbytes == code_bytes + steps * 104 * 512 // 16 + 104 * 2 * 2 * 2


@needs_kernels
@pytest.mark.parametrize(
    "qtype",
    [QType.Q2_K, QType.Q3_K, QType.IQ2_XXS, QType.IQ1_M],  # IQ: levels, groups of 32 and 16
    ids=lambda q: q.name,
)
@pytest.mark.parametrize("integers", [True, False], ids=["int-activations", "float"])
def test_three_bit_codes_multiply_as_the_same_codes_in_nibbles(
    qtype: QType, integers: bool, blas_from_128: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Codes kept in three bits (here on every build), widened in registers by the x86
    integer tiles and into a buffer a few panels at a time elsewhere: every product (one row
    to BLAS's slices, with and without integer activations), row lookup and MoE layer gives
    the bits of the same codes kept in nibbles. (The IQ formats here without their book
    entries, `Runs`, which take precedence.)"""
    monkeypatch.setattr(native_module, "keeps_three_bits", lambda: True)
    check_same_bits_as_nibbles(qtype, lambda c: c._replace(runs=None), 3, integers)


@needs_kernels
@pytest.mark.parametrize(
    ("qtype", "entry_bytes"),
    # groups of 32, 16, 32, 16; 24-bit entries: a pattern and signs (IQ2_S's of 16 inputs)
    [
        *((QType.IQ2_XXS, 2), (QType.IQ2_XS, 2), (QType.IQ1_S, 2), (QType.IQ1_M, 2)),
        *((QType.IQ3_XXS, 3), (QType.IQ2_S, 3)),
    ],
    ids=lambda v: v.name if isinstance(v, QType) else str(v),
)
@pytest.mark.parametrize("integers", [True, False], ids=["int-activations", "float"])
def test_book_entries_multiply_as_the_same_codes_in_nibbles(
    qtype: QType,
    entry_bytes: int,
    integers: bool,
    blas_from_128: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IQ1, IQ2 and IQ3_XXS weights keep an entry of their format's book a run of 8 inputs (16
    or 24 bits: 100 rows of 512 pad to 104 and take 104 * 64 entries) where that is smaller
    than their codes (here in nibbles), which the kernels look up a unit's panels at a
    time: every product, row lookup and MoE layer gives the bits of the same codes kept in
    nibbles."""
    monkeypatch.setattr(native_module, "keeps_three_bits", lambda: False)
    native = check_same_bits_as_nibbles(qtype, lambda c: c, 2, integers)
    assert native.words.nbytes == 104 * 64 * entry_bytes
    # the kernels read the book unchecked: an entry past it is refused at load
    codes = decode(torch.from_numpy(random_blocks(qtype, 8, 256)), qtype, 256)
    assert codes.runs is not None
    codes.runs.entries[3, 5] = codes.runs.entry_limit
    with pytest.raises(ValueError, match="past the end of their book"):
        NativeWeight(codes)


def check_same_bits_as_nibbles(
    qtype: QType, keep: Callable[[Codes], Codes], code_bits: int, integers: bool
) -> NativeWeight:
    """`keep(codes)` of `qtype` packed as `code_bits` gives the bits of its codes in nibbles on
    every path; returns the packed weight."""

    def nibbles_of(codes: Codes) -> Codes:
        return codes._replace(runs=None).centered()._replace(bits=4)

    codes = decode(torch.from_numpy(random_blocks(qtype, 100, 512, seed=5)), qtype, 512)
    packed, nibbles = NativeWeight(keep(codes)), NativeWeight(nibbles_of(codes))
    assert (packed.code_bits, nibbles.code_bits) == (code_bits, 4)
    x = torch.randn(BLAS_FROM + 3, 512, generator=torch.Generator().manual_seed(6))
    try:
        torch.ops.aserve_cpu.int_activations(integers)
        for rows in (1, 2, 3, 5, 16, 70, BLAS_FROM + 3):
            packed_out, nibbles_out = packed.linear(x[:rows], None), nibbles.linear(x[:rows], None)
            assert torch.equal(packed_out, nibbles_out), rows
    finally:
        torch.ops.aserve_cpu.int_activations(True)
    ids = torch.tensor([0, 7, 8, 99])
    assert torch.equal(packed.rows(ids), codes.dequantize()[ids])
    # a MoE layer of such experts: gate|up 512 x 256, down 256 x 256
    hidden, inter, experts = 256, 256, 4
    parts = [
        [decode(torch.from_numpy(random_blocks(qtype, rows, cols, seed=e)), qtype, cols)
         for e in range(experts)]
        for rows, cols in ((2 * inter, hidden), (hidden, inter))
    ]  # fmt: skip
    router = torch.randn(experts, hidden, generator=torch.Generator().manual_seed(7)) / 16
    tokens = torch.randn(20, hidden, generator=torch.Generator().manual_seed(8))
    layers = []
    for form, bits in ((keep, code_bits), (nibbles_of, 4)):
        stacks = [ExpertStack([NativeWeight(form(c)) for c in part]) for part in parts]
        assert {s.code_bits for s in stacks} == {bits}
        layers.append(moe_layer(tokens, router, 2, True, *stacks, inter))
    assert torch.equal(layers[0], layers[1])
    return packed


def test_book_entries_no_smaller_than_three_bit_codes_give_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IQ2_S's 24-bit entries take as many bits as its codes in three bits, which multiply
    faster: it keeps those where they are kept, and its entries elsewhere."""
    codes = decode(torch.from_numpy(random_blocks(QType.IQ2_S, 16, 256)), QType.IQ2_S, 256)
    assert codes.runs is not None and codes.runs.entry_bits == 24
    for three, code_bits in ((True, 3), (False, 2)):
        monkeypatch.setattr(native_module, "keeps_three_bits", lambda t=three: t)
        assert NativeWeight(codes).code_bits == code_bits


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_book_entries_stand_for_the_codes(qtype: QType) -> None:
    """The formats whose runs of 8 inputs are entries of a book (IQ1, IQ2, IQ3_XXS) give them
    with the codes, the entries' codes equal to the codes through
    padding, splits and joins, each entry under 2**entry_bits and the format's one book
    shared; no other format does."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 12, 512, seed=5)), qtype, 512)
    assert (codes.runs is not None) == (qtype.name in iquants.RUN_FORMATS)
    if codes.runs is None:
        return
    book = codes.runs.kernel_book

    def check(c: Codes) -> None:
        assert c.runs is not None and c.runs.kernel_book is book
        assert int(c.runs.entries.max()) < 1 << c.runs.entry_bits
        assert torch.equal(c.runs.codes_of(c.runs.entries).view(c.shape), c.codes)

    check_through_row_changes(codes, check)


@pytest.mark.parametrize("name", iquants.RUN_FORMATS)
def test_a_books_split_tables_give_every_entrys_codes(name: str) -> None:
    """`split_book`'s small tables (CUDA's form of a book) XOR to the codes of every 16-bit
    entry, and of every 24-bit one's pattern under each of its 256 sign bytes (patterns
    sampled), in at most 2,050 words (8 KiB) of tables where the book takes up to 65,792."""
    from aserve.quant.codes import split_book, split_book_codes

    book = iquants.runs_book(name)
    tables, low_bits, signs_at = split_book(book.kernel_book)
    assert len(tables) <= 2050 and (signs_at > 0) == (book.entry_bits == 24)
    if book.entry_bits == 16:
        entries = torch.arange((book.kernel_book.numel() - 20) // 4)
    else:
        seeded = torch.Generator().manual_seed(9)
        high = 256 if name == "IQ3_XXS" else 4  # IQ2_S's grid indices are of 10 bits
        patterns = torch.randint(0, high, (64,), generator=seeded) << 8
        patterns |= torch.randint(0, 256, (64,), generator=seeded)
        entries = (patterns[:, None] | torch.arange(256) << 16).flatten()
    codes = split_book_codes((tables, low_bits, signs_at), entries)
    assert torch.equal(codes.long(), book.codes_of(entries).long())


@needs_kernels
@pytest.mark.parametrize(
    ("qtype", "code_bytes", "scale_bytes"),
    [(QType.Q4_0, 0.5, 2), (QType.Q5_0, 0.75, 2), (QType.Q3_K, None, 1), (QType.Q6_K, 0.75, 1)],
    ids=lambda v: v.name if isinstance(v, QType) else str(v),
)
def test_codes_centred_on_zero_store_no_offsets(
    qtype: QType, code_bytes: float | None, scale_bytes: int, blas_from_128: None
) -> None:
    """Formats whose offset is -2**(bits - 1) times the scale keep codes centred on zero
    (a table of levels up to 4 bits, int8 above) and no offsets, the same weight exactly:
    every row looked up equals the file's, products match float64 within float32 rounding
    on every path, and a row keeps its bits alone and batched."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 64, 512, seed=3)), qtype, 512)
    centred = codes.centered()
    assert centred.table is not None and not centred.offsets.any()
    weight = codes.dequantize()
    assert torch.equal(centred.dequantize(), weight)
    native = NativeWeight(codes)
    assert native.offsets.numel() == 0
    if code_bytes is None:  # 3-bit codes: nibbles unless the kernels widen them in registers
        code_bytes = 0.375 if native_module.keeps_three_bits() else 0.5
    assert native.words.nbytes == 64 * 512 * code_bytes
    assert native.scales.element_size() == scale_bytes  # float16, or int8 steps (K-quants)
    assert torch.equal(native.rows(torch.arange(64)), weight)
    x = torch.randn(BLAS_FROM + 3, 512, generator=torch.Generator().manual_seed(4))
    exact = F.linear(x.double(), weight.double())
    tolerance = 1e-5 * float(exact.abs().max())
    batched = native.linear(x[:20], None)
    rounded = F.linear(as_the_kernels_round(x, native), weight.double())
    torch.testing.assert_close(batched.double(), rounded[:20], rtol=0, atol=tolerance)
    torch.testing.assert_close(native.linear(x, None).double(), rounded, rtol=0, atol=tolerance)
    for rows in (1, 2, 3, 5):
        assert torch.equal(native.linear(x[7 : 7 + rows], None), batched[7 : 7 + rows]), rows


def test_codes_with_their_own_offsets_are_not_centred() -> None:
    """Q4_1 and Q4_K (a stored minimum) and IQ4_NL (a table already) stay as decoded."""
    for qtype in (QType.Q4_1, QType.Q4_K, QType.IQ4_NL):
        codes = decode(torch.from_numpy(random_blocks(qtype, 8, 256)), qtype, 256)
        assert codes.centered() is codes, qtype.name


def write_tiny_llama(path: Path, qtype: QType, seed: int = 0) -> None:
    """A 2-layer llama GGUF with `qtype` matrices (random codes), float32 norms, no
    tokenizer: hidden 256 so that K-quant super-blocks of 256 fit."""
    hidden, inter, vocab, heads, kv_heads = 256, 512, 320, 4, 2
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_context_length(256)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(seed)
    matrices = {"token_embd.weight": (vocab, hidden)}
    for layer in range(2):
        matrices |= {
            f"blk.{layer}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{layer}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{layer}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{layer}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{layer}.ffn_gate.weight": (inter, hidden),
            f"blk.{layer}.ffn_up.weight": (inter, hidden),
            f"blk.{layer}.ffn_down.weight": (hidden, inter),
        }
        for norm in ("attn_norm", "ffn_norm"):
            weight = 1 + 0.1 * rng.standard_normal(hidden)
            writer.add_tensor(f"blk.{layer}.{norm}.weight", weight.astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for index, (name, (rows, cols)) in enumerate(matrices.items()):
        raw = random_blocks(qtype, rows, cols, seed=seed * 100 + index)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def first_differences(ours: list[list[int]], theirs: list[list[int]], length: int) -> list[int]:
    """Per prompt, the index of the first token where two generations part (`length` where
    they never do)."""
    return [
        next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), length)
        for x, y in zip(ours, theirs)
    ]


def greedy_parting(ours: LLM, theirs: LLM, prompts: list[str], length: int) -> list[int]:
    """`first_differences` of two models' greedy generations of `length` tokens."""
    greedy = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
    return first_differences(
        [o.token_ids for o in ours.generate(prompts, greedy)],
        [o.token_ids for o in theirs.generate(prompts, greedy)],
        length,
    )


TINY_PROMPTS = [[(7 * i + 3 * j) % 300 + 2 for j in range(5 + i)] for i in range(6)]


def first_tokens_agreeing(
    ours: LLM, theirs: LLM, max_tokens: int = 6
) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """How many of TINY_PROMPTS get the same first greedy token from both models, and both
    models' tokens (for the assertion's message)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    pairs = [
        (a.token_ids, b.token_ids)
        for a, b in zip(ours.generate(TINY_PROMPTS, greedy), theirs.generate(TINY_PROMPTS, greedy))
    ]
    return sum(a[0] == b[0] for a, b in pairs), pairs


def assert_dequantized_generates_as(
    make_llm: Callable[..., LLM], folder: Path, twin: LLM, max_tokens: int = 8
) -> None:
    """With `--quantization none` a quantized checkpoint loads de-quantized to float32: its
    float twin's greedy tokens exactly."""
    as_float = make_llm(folder, num_pages=256, quantization="none")
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ours = [o.token_ids for o in as_float.generate(TINY_PROMPTS, greedy)]
    assert ours == [o.token_ids for o in twin.generate(TINY_PROMPTS, greedy)]


def assert_refused_in_one_line(model: Path, options: list[str], message: str, cache: Path) -> None:
    """`aserve --model MODEL --shell OPTIONS` exits with one error line holding `message`."""
    result = subprocess.run(
        [sys.executable, "-m", "aserve", "--model", str(model), "--shell", *options],
        capture_output=True,
        text=True,
        timeout=120,
        env={"ASERVE_CACHE_DIR": str(cache), "PATH": "/usr/bin:/bin"},
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert lines[-1].startswith("aserve: error: ") and message in lines[-1], lines
    assert sum("error" in line for line in lines) == 1, lines


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_tiny_gguf_of_each_format_runs_quantized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_llm: Callable[..., LLM], qtype: QType
) -> None:
    """Loaded quantized (a matrix takes about its file bytes, not float32's), the first greedy
    token of at least 5 of 6 prompts is that of the float32 de-quantized weights. Random
    codes make a model of near-ties that the order of float sums can tip; the products
    themselves are checked to 1e-5 above."""
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_llama(model, qtype)
    quantized = make_llm(model, num_pages=256)
    reference = make_llm(model, num_pages=256, quantization="none")
    assert quantized.runtime.model_config.quantization == "gguf"
    layer = quantized.runtime.engine.model.model.layers[0].mlp.gate_up_proj
    assert layer.weight is None and layer.quantized.nbytes < 512 * 256 * 2 * 2
    agree, pairs = first_tokens_agreeing(quantized, reference)
    assert agree >= 5, pairs


@needs_kernels
def test_embedded_model_decodes_alike_batched_alone_and_through_sdpa(
    make_llm: Callable[..., LLM], smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Quantized on CPU, decode attention is aserve's kernel reading the pool. Each request's
    operations do not depend on its batch (products below BLAS_FROM rows, and the attention),
    so the 8 prompts generate the same tokens together and one at a time; against the staged
    SDPA path only float sums' order differs (where they part is printed)."""
    from tests.test_generation import TEXTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    together = make_llm(smollm2_dir)
    assert together.runtime.engine.attn.native_decode
    tokens = [o.token_ids for o in together.generate(TEXTS, greedy)]
    alone = make_llm(smollm2_dir, max_running_requests=1)
    assert [o.token_ids for o in alone.generate(TEXTS, greedy)] == tokens
    attn = together.runtime.engine.attn
    attn.native_decode, attn.use_stage = False, True
    staged = [o.token_ids for o in together.generate(TEXTS, greedy)]
    parted = first_differences(tokens, staged, 24)
    with capsys.disabled():
        print(f"\nembedded Q4_1, decode kernel against SDPA, first differing token: {parted}")
    assert min(parted) >= 8


@needs_kernels
def test_float16_kv_cache_on_cpu(
    make_llm: Callable[..., LLM],
    smollm2_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A float16 KV cache, the default of quantized models on CPU: the embedded Q4_1 model
    keeps K and V in half the bytes of `--kv-cache-dtype float32` (twice the tokens in the
    same memory), its decode kernel reads them, batches still do not change a request's
    tokens, and greedy tokens mostly follow the float32 cache's (where they part is
    printed). A float model's staged decode path reads the same rounded values:
    a radix hit then gives exactly what recomputing the prefix would."""
    from tests.test_generation import TEXTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    half = make_llm(smollm2_dir, num_pages=2048)  # auto: float16 for quantized models on CPU
    full = make_llm(smollm2_dir, kv_cache_dtype="float32", num_pages=2048)
    engine = half.runtime.engine
    assert engine.pool.kv[0].dtype == torch.float16 and engine.attn.native_decode
    assert engine.kv_cache_bytes * 2 == full.runtime.engine.kv_cache_bytes
    tokens = [o.token_ids for o in half.generate(TEXTS, greedy)]
    alone = make_llm(smollm2_dir, kv_cache_dtype="float16", max_running_requests=1)
    assert [o.token_ids for o in alone.generate(TEXTS, greedy)] == tokens
    parted = first_differences(tokens, [o.token_ids for o in full.generate(TEXTS, greedy)], 24)
    with capsys.disabled():
        print(f"\nembedded Q4_1, float16 KV against float32 KV, first differing token: {parted}")
    assert sum(p >= 12 for p in parted) >= 6, parted

    folder = make_tiny_model("llama", tmp_path / "llama")
    assert make_llm(folder, num_pages=64).runtime.engine.pool.kv[0].dtype == torch.float32
    # float weights on the kernels read the cache in their decode attention; on torch's
    # float path (dummy or MoE weights, or no kernels) the staged decode reads it
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(engine_module, "float_weights_on_kernels", lambda *args: None)
        tiny = make_llm(folder, num_pages=512, kv_cache_dtype="float16")
        assert tiny.runtime.engine.attn.native_decode == kernels
        ours = [o.token_ids for o in tiny.generate(TINY_PROMPTS, greedy)]
        longer = [prompt + out[:6] for prompt, out in zip(TINY_PROMPTS, ours)]
        again = [o.token_ids for o in tiny.generate(longer, greedy)]
        fresh = make_llm(folder, num_pages=512, kv_cache_dtype="float16")
        assert again == [o.token_ids for o in fresh.generate(longer, greedy)]


def test_float_kv_cache_dtypes_refused_for_16_bit_models(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "llama")
    for kv_dtype in ("float16", "float32"):
        assert_refused_in_one_line(
            folder,
            ["--device", "cpu", "--dtype", "bfloat16", "--kv-cache-dtype", kv_dtype],
            f"--kv-cache-dtype {kv_dtype} is for a float32 model's cache on CPU; for a "
            "bfloat16 model on cpu take auto",
            tmp_path / "cache",
        )


@needs_kernels
def test_embedded_model_quantized_against_its_float32_path(
    make_llm: Callable[..., LLM], smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The embedded Q4_1 model on the kernels against the same weights de-quantized to
    float32: only the order of float sums differs, and on CPUs with VNNI the kernels'
    16-bit activations (24 of 24 tokens agree for all 8 prompts here, either way); where they
    part is printed."""
    from tests.test_generation import TEXTS

    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    quantized = make_llm(smollm2_dir)
    float32 = make_llm(smollm2_dir, quantization="none")
    parted = greedy_parting(quantized, float32, TEXTS, 24)
    with capsys.disabled():
        print(f"\nembedded Q4_1 against float32, first differing token of 8 prompts: {parted}")
    assert "Paris" in quantized.generate(TEXTS[0], greedy)[0].text
    assert min(parted) >= 8


def test_bad_gguf_files_are_one_line(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    write_tiny_llama(truncated, QType.Q4_0)
    truncated.write_bytes(truncated.read_bytes()[:-5000])
    unsupported = tmp_path / "unsupported.gguf"
    writer = gguf.GGUFWriter(unsupported, "llama")
    for key, value in (("block_count", 1), ("embedding_length", 256)):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_context_length(64)
    raw = np.zeros((8, 54), np.uint8)  # one TQ1_0 (ternary) super-block a row
    writer.add_tensor("token_embd.weight", raw, raw_dtype=QType.TQ1_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path, message in (
        (truncated, "is not a whole GGUF file (truncated or damaged"),
        (unsupported, "token_embd.weight is TQ1_0, which aserve cannot run"),
    ):
        assert_refused_in_one_line(path, [], message, tmp_path / "cache")


@pytest.mark.parametrize(("bits", "bound"), [(8, 0.01), (4, 0.12)])
def test_quantize_keeps_a_float_weight_within_its_step(bits: int, bound: float) -> None:
    """Gaussian weights lose about 0.6% (int8, steps of max|w| / 127) and 9% (int4, 15 steps
    from min to max) of their norm; a group's largest magnitude (int8) or its minimum and
    maximum (int4) come back to float rounding."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    codes = quantize(weight, bits)
    back = codes.dequantize()
    assert codes.bits == bits and codes.group == 32 and codes.codes.dtype == torch.uint8
    assert float((back - weight).norm() / weight.norm()) < bound
    grouped, restored = weight.view(64, 8, 32), back.view(64, 8, 32)
    extremes = (
        [lambda t: t.abs().amax(-1)] if bits == 8 else [lambda t: t.amax(-1), lambda t: t.amin(-1)]
    )
    for extreme in extremes:
        torch.testing.assert_close(extreme(restored), extreme(grouped), rtol=1e-5, atol=1e-6)


@needs_kernels
@pytest.mark.parametrize(
    ("family", "method"), [("llama", "int8"), ("llama", "int4"), ("qwen3", "int8")]
)
def test_float_checkpoint_quantized_at_load(
    tmp_path: Path, make_llm: Callable[..., LLM], family: str, method: str
) -> None:
    """`--quantization int8|int4` on a float checkpoint: the linear layers hold codes (about
    1 or 0.5 bytes a weight), greedy tokens mostly those of the float model (tiny random
    models are full of near-ties: int8 must agree on 5 of 6 first tokens, int4 on 3), and
    dummy weights quantize too. Qwen3's Q/K norms then run in the CPU kernels'
    `norm_rope_store`, the float model's in PyTorch."""
    folder = make_tiny_model(family, tmp_path / family)
    quantized = make_llm(folder, num_pages=256, quantization=method)
    reference = make_llm(folder, num_pages=256)
    assert quantized.runtime.model_config.quantization == method
    assert quantized.runtime.engine.weight_bytes < reference.runtime.engine.weight_bytes
    layer = quantized.runtime.engine.model.model.layers[0].mlp.gate_up_proj
    weights = 256 * 64
    assert layer.weight is None and layer.quantized.nbytes < weights * (
        1.3 if method == "int8" else 0.8
    )
    agree, pairs = first_tokens_agreeing(quantized, reference, max_tokens=8)
    print(f"\n{method}: first greedy token agrees on {agree} of 6 prompts")
    assert agree >= (5 if method == "int8" else 3), pairs
    dummy = make_llm(folder, num_pages=256, dummy_weight=True, quantization=method)
    assert dummy.runtime.engine.model.model.layers[0].mlp.gate_up_proj.quantized.products
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(dummy.generate(TINY_PROMPTS[0], greedy)[0].token_ids) == 8


def test_quantization_choices_refused_in_one_line(tmp_path: Path) -> None:
    """int4 on an already quantized GGUF, and a checkpoint in a format aserve does not run."""
    tiny = tmp_path / "tiny.gguf"
    write_tiny_llama(tiny, QType.Q4_0)
    nf4 = make_tiny_model("llama", tmp_path / "nf4")
    config = json.loads((nf4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (nf4 / "config.json").write_text(json.dumps(config))
    for model, options, message in (
        (tiny, ["--quantization", "int4"], "this one is already quantized (GGUF)"),
        (nf4, [], "bitsandbytes checkpoints are not supported"),
    ):
        assert_refused_in_one_line(model, options, message, tmp_path / "cache")


def test_each_torch_installation_builds_its_own_cpu_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two environments with the same torch version (a venv beside the system Python) get
    folders of their own: sharing one, each rebuilt it in turn."""
    here = build_kind()
    assert here == build_kind()
    assert f"torch{torch.__version__}" in here
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv" / "torch" / "__init__.py"))
    there = build_kind()
    assert there != here and there.rsplit("-", 1)[0] == here.rsplit("-", 1)[0]


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.IQ4_XS], ids=lambda q: q.name)
def test_products_are_the_same_bits_on_one_thread_and_two(qtype: QType) -> None:
    """The kernels split outputs between threads (built with OpenMP where torch runs on it:
    without, `at::parallel_for` ran every product on one core); an output's operations do
    not depend on the thread that runs it, so the bits do not either."""
    from aserve.quant.native import openmp_flags

    if sys.platform.startswith("linux") and torch._C.has_openmp:
        assert openmp_flags() == ["-fopenmp"]
    codes = decode(torch.from_numpy(random_blocks(qtype, 200, 512, seed=5)), qtype, 512)
    native = NativeWeight(codes)
    x = torch.randn(BLAS_FROM - 1, 512, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = [native.linear(x[:rows], None) for rows in (1, 5, BLAS_FROM - 1)]
        torch.set_num_threads(1)
        one = [native.linear(x[:rows], None) for rows in (1, 5, BLAS_FROM - 1)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q8_0, QType.IQ4_NL])
def test_one_call_for_a_group_of_weights_gives_each_products_bits(qtype: QType) -> None:
    """`linear_group` (a token's chosen experts in one parallel region) against each weight's
    own `linear`: bit for bit, whatever rows each weight has and its rows padded to a panel."""
    weights = [
        NativeWeight(decode(torch.from_numpy(random_blocks(qtype, rows, 256, seed)), qtype, 256))
        for seed, rows in enumerate((64, 100, 8, 37))
    ]
    generator = torch.Generator().manual_seed(7)
    xs = [torch.randn(rows, 256, generator=generator) for rows in (1, 3, 17, 1)]
    assert one_format(weights)
    together = linear_group(weights, xs)
    for weight, x, out in zip(weights, xs, together, strict=True):
        assert torch.equal(out, weight.linear(x, None))


@needs_kernels
def test_a_group_of_weights_shares_one_code_format() -> None:
    """What `linear_group` takes in one call: codes kept alike (5 bits are kept as a nibble
    and two bits, as 6 are, not as bytes; Q4_0's codes centred on zero and IQ4's levels are
    two tables)."""
    kept = {
        qtype: NativeWeight(decode(torch.from_numpy(random_blocks(qtype, 8, 256)), qtype, 256))
        for qtype in (QType.Q4_0, QType.Q4_1, QType.Q8_0, QType.IQ4_NL, QType.Q5_1, QType.Q5_K)
    }
    assert one_format([kept[QType.Q5_1], kept[QType.Q5_K]])
    assert not one_format([kept[QType.Q8_0], kept[QType.Q5_1]])
    assert not one_format([kept[QType.Q4_1], kept[QType.Q8_0]])
    assert not one_format([kept[QType.Q4_0], kept[QType.IQ4_NL]])


@needs_kernels
def test_a_product_group_calls_the_kernels_once_only_for_what_they_take_together(
    blas_from_128: None,
) -> None:
    """A step's chosen experts: one call of the kernels for decode rows, one product at a time
    from BLAS_FROM rows (BLAS's path) or where the weights' formats differ; the same outputs
    every way."""

    def group(qtypes: list[QType]) -> ProductGroup:
        made = ProductGroup(len(qtypes), [40], 256, "gguf")
        for seed, (weight, qtype) in enumerate(zip(made.weights, qtypes)):
            raw = torch.from_numpy(random_blocks(qtype, 40, 256, seed))
            weight.load(0, QuantizedTensor(raw, qtype, 256))
        made.finalize(torch.device("cpu"), torch.float32, Scratch())
        return made

    alike = group([QType.Q4_K] * 3)
    assert alike.native is not None and group([QType.Q4_K, QType.Q8_0]).native is None
    generator = torch.Generator().manual_seed(3)
    calls = 0
    kernel = torch.ops.aserve_cpu.linear_group

    def counted(*args: object) -> list[torch.Tensor]:
        nonlocal calls
        calls += 1
        return kernel(*args)

    for rows in (1, 5, BLAS_FROM):
        xs = [torch.randn(rows, 256, generator=generator) for _ in range(2)]
        alone = [alike.weights[i].linear(x, None) for i, x in zip((2, 0), xs)]
        before = calls
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.ops.aserve_cpu, "linear_group", counted)
            together = alike.linear([2, 0], xs)
        assert calls - before == (rows < BLAS_FROM)
        assert all(map(torch.equal, together, alone))


@needs_kernels
@pytest.mark.parametrize(
    ("renormalize", "family"),
    [(True, ""), (False, ""), (True, "gpt_oss"), (True, "glm4_moe"), (False, "glm4_moe")],
    ids=["renormalized", "softmax-weights", "gpt-oss", "glm-4.5", "glm-4.5-unnormalized"],
)
def test_a_moe_layer_in_one_call_equals_routing_and_grouped_products(
    renormalize: bool, family: str
) -> None:
    """`moe_layer` (decode's whole MoE layer, router included, in one call of the kernels)
    against layers/moe.route and the grouped Python path around the same products, for 1 to
    40 tokens; and a token's output does not depend on the tokens beside it (bit for bit).
    gpt-oss's experts: the router's bias, the experts' biases and the clamped SwiGLU (the
    grouped path's `activate`), with and without the down biases. GLM-4.5's: sigmoid scores,
    experts chosen with a bias of their own, weighed times a scaling (`route_deepseek`)."""
    gpt_oss = family == "gpt_oss"
    experts, hidden, inter, top_k = 6, 256, 64, 2

    def group(qtype: QType, rows: int, cols: int, seed: int) -> ProductGroup:
        made = ProductGroup(experts, [rows], cols, "gguf")
        for index, weight in enumerate(made.weights):
            raw = torch.from_numpy(random_blocks(qtype, rows, cols, seed * 10 + index))
            weight.load(0, QuantizedTensor(raw, qtype, cols))
        made.finalize(torch.device("cpu"), torch.float32, Scratch())
        return made

    gate_up = group(QType.Q4_K, 2 * inter, hidden, 1)
    down = group(QType.Q8_0, hidden, inter, 2)
    assert gate_up.native is not None and down.native is not None
    stacks = ExpertStack(gate_up.native), ExpertStack(down.native)
    generator = torch.Generator().manual_seed(4)
    router = torch.randn(experts, hidden, generator=generator) / 16
    style, router_bias, b13, b2 = PLAIN_EXPERTS, None, None, None
    if gpt_oss:
        style = ExpertStyle(biases=True, swiglu_alpha=1.702, swiglu_limit=500.0)
        router_bias = torch.randn(experts, generator=generator)
        b13 = torch.randn(experts, 2 * inter, generator=generator) * 100
        b2 = torch.randn(experts, hidden, generator=generator) * 100
    glm = RouterStyle(sigmoid=True, scaling=2.5)
    choice_bias = torch.randn(experts, generator=generator) if family == "glm4_moe" else None

    def grouped(x: torch.Tensor, down_bias: torch.Tensor | None) -> torch.Tensor:
        def mlp(chosen: list[int], parts: list[torch.Tensor]) -> list[torch.Tensor]:
            products = gate_up.linear(chosen, parts)
            if b13 is not None:
                products = [p + b13[e] for e, p in zip(chosen, products)]
            acts = activate(torch.cat(products), style).split([len(p) for p in parts])
            outs = down.linear(chosen, list(acts))
            if down_bias is not None:
                outs = [o + down_bias[e] for e, o in zip(chosen, outs)]
            return outs

        logits = F.linear(x, router, router_bias)
        if choice_bias is None:
            weights, ids = route(logits, top_k, renormalize)
        else:
            weights, ids = route_deepseek(logits, choice_bias, top_k, renormalize, glm, x.dtype)
        return grouped_experts(x, weights, ids, experts, mlp)

    for down_bias in (b2, None) if gpt_oss else (None,):
        extra = (router_bias, b13, down_bias, style, choice_bias, glm.scaling)
        for tokens in (1, 5, 40, 300):
            x = torch.randn(tokens, hidden, generator=generator)
            together = moe_layer(x, router, top_k, renormalize, *stacks, inter, *extra)
            expected = grouped(x, down_bias)  # random codes: outputs of ~1,000
            scale = float(expected.abs().max())
            torch.testing.assert_close(together, expected, atol=1e-5 * scale, rtol=0)
            alone = moe_layer(x[-1:], router, top_k, renormalize, *stacks, inter, *extra)
            assert torch.equal(alone[0], together[-1])


def test_openmp_flags_give_the_kernels_torchs_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux builds with -fopenmp. macOS, whose compilers take no -fopenmp, with the libomp
    and omp.h that torch's wheel ships, found beside torch (without them, none: the kernels
    then run on one thread, as before). A torch without OpenMP, or another platform: none."""
    from aserve.quant.native import openmp_flags

    monkeypatch.setattr(torch._C, "has_openmp", True)
    assert openmp_flags("linux", tmp_path) == ["-fopenmp"]
    assert openmp_flags("darwin", tmp_path) == []
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libomp.dylib").touch()
    assert openmp_flags("darwin", tmp_path) == []  # no omp.h to compile against
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "omp.h").touch()
    lib = tmp_path / "lib"
    assert openmp_flags("darwin", tmp_path) == [
        "-Xpreprocessor",
        "-fopenmp",
        f"-L{lib}",
        "-lomp",
        f"-Wl,-rpath,{lib}",
    ]
    assert openmp_flags("win32", tmp_path) == []
    monkeypatch.setattr(torch._C, "has_openmp", False)
    assert openmp_flags("linux", tmp_path) == openmp_flags("darwin", tmp_path) == []


def test_kernels_build_with_the_first_flags_a_compiler_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that refuses -march=native (some of Apple's) builds with -mcpu=native next,
    with OpenMP before without; one that refuses every flag builds the portable tiles; none
    at all gives False and one warning."""
    monkeypatch.setattr(native_module, "openmp_flags", lambda: ["-fopenmp"])
    tried: list[tuple[tuple[str, ...], list[str]]] = []

    def compiler_refusing(refused: set[str]) -> Callable[..., None]:
        def load(folder: Path, flags: list[str], arch: tuple[str, ...]) -> None:
            tried.append((arch, flags))
            if refused & {*arch, *flags}:
                raise RuntimeError(f"error: unsupported option {sorted(refused)[0]}\nmore")

        return load

    monkeypatch.setattr(native_module, "load_kernels", compiler_refusing({"-march=native"}))
    assert native_module.build_kernels(tmp_path)
    assert tried == [
        (("-march=native",), ["-fopenmp"]),
        (("-march=native",), []),
        (("-mcpu=native",), ["-fopenmp"]),
    ]
    assert "-mcpu=native -fopenmp after the first try failed" in caplog.text
    tried.clear()
    monkeypatch.setattr(
        native_module, "load_kernels", compiler_refusing({"-march=native", "-mcpu=native"})
    )
    assert native_module.build_kernels(tmp_path)
    assert tried[-1] == ((), ["-fopenmp"])

    def no_compiler(folder: Path, flags: list[str], arch: tuple[str, ...]) -> None:
        raise FileNotFoundError("c++: not found")

    monkeypatch.setattr(native_module, "load_kernels", no_compiler)
    caplog.clear()
    assert not native_module.build_kernels(tmp_path)
    assert caplog.text.count("did not build (c++: not found)") == 1


def test_blas_or_kernels_for_many_rows_is_measured_once_and_kept(tmp_path: Path) -> None:
    """BLAS from the fewest of BLAS_ROWS rows where it multiplied faster than the kernels
    (asked from the most rows down, until the kernels win), else never; each product kind's
    choice kept in the kernels' folder and read back instead of measuring again; a kept file
    that cannot be read, or that other kernels' sources measured, is measured over."""
    asked: list[int] = []

    def timer(blas_wins_from: int) -> Callable[[int], tuple[float, float]]:
        def time(rows: int) -> tuple[float, float]:
            asked.append(rows)
            return (2.0, 1.0) if rows >= blas_wins_from else (1.0, 2.0)

        return time

    decide = native_module.decide_blas_rows
    for wins_from, expected, times in (
        (1, 128, [512, 256, 128]),
        (200, 256, [512, 256, 128]),
        (512, 512, [512, 256]),
        (1000, NEVER, [512]),
    ):
        asked.clear()
        assert decide(tmp_path, f"codes{wins_from}", timer(wins_from)) == expected, wins_from
        assert asked == times, wins_from
    asked.clear()
    assert decide(tmp_path, "codes200", timer(1)) == 256  # kept: not measured
    assert decide(tmp_path, "levels4", timer(1)) == 128  # another kind: measured
    assert asked == [512, 256, 128]
    kept = tmp_path / "blas_rows.codes200.json"
    kept.write_text("{")
    assert decide(tmp_path, "codes200", timer(1000)) == NEVER  # measured anew
    kept.write_text(json.dumps(json.loads(kept.read_text()) | {"kernels": "older"}))
    assert decide(tmp_path, "codes200", timer(1)) == 128  # measured anew
    asked.clear()
    assert decide(tmp_path, "codes200", timer(1000)) == 128  # kept: not measured
    assert asked == []


def test_the_first_process_to_keep_its_choice_decides_for_all(tmp_path: Path) -> None:
    """Two processes measuring at once (tensor-parallel ranks): the one that keeps its answer
    first wins, and the other returns that answer, not its own measurement."""

    def measured_while_another_kept_blas(rows: int) -> tuple[float, float]:
        kept = {"blas_rows": 256, "kernels": native_module.kernels_version()}
        (tmp_path / "blas_rows.codes4.json").write_text(json.dumps(kept))
        return 1.0, 2.0  # this process found the kernels faster

    decided = native_module.decide_blas_rows(tmp_path, "codes4", measured_while_another_kept_blas)
    assert decided == 256
    assert [p.name for p in tmp_path.iterdir()] == ["blas_rows.codes4.json"]


def test_one_row_prefetch_follows_the_faster_way_and_is_kept(tmp_path: Path) -> None:
    """One-row products ask for panels ahead unless they were faster without, measured once
    and kept for the kernels that measured it, like the BLAS choice."""
    asked: list[int] = []

    def timer(ahead_ms: float, plain_ms: float) -> Callable[[], tuple[float, float]]:
        def time() -> tuple[float, float]:
            asked.append(1)
            return ahead_ms, plain_ms

        return time

    decide = native_module.decide_one_row_prefetch
    assert decide(tmp_path, timer(3.0, 4.0)) is True
    assert decide(tmp_path, timer(4.0, 3.0)) is True  # kept: not measured
    assert len(asked) == 1
    kept = tmp_path / "one_row_prefetch.json"
    kept.write_text(json.dumps(json.loads(kept.read_text()) | {"kernels": "older"}))
    assert decide(tmp_path, timer(4.0, 3.0)) is False  # other kernels' answer: measured anew
    assert decide(tmp_path, timer(3.0, 4.0)) is False and len(asked) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["one_row_prefetch.json"]


@needs_kernels
@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_K, QType.Q6_K, QType.Q8_0], ids=str)
def test_panels_asked_ahead_or_not_give_the_same_bits(qtype: QType) -> None:
    """Asking for the next panels ahead moves bytes earlier, never a float operation: every
    row count's products are bit for bit the same with one-row tiles asking or not."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 96, 512, seed=5)), qtype, 512)
    settled = torch.ops.aserve_cpu.one_row_prefetch(None)
    try:
        same_bits_either_way(
            NativeWeight(codes), torch.ops.aserve_cpu.one_row_prefetch, (1, 3, 16, 40)
        )
    finally:
        torch.ops.aserve_cpu.one_row_prefetch(settled)


def same_bits_either_way(
    native: NativeWeight, switch: Callable[[bool], object], rows: tuple[int, ...]
) -> None:
    """Every row count's product through `native`'s kernels is bit for bit the same with
    `switch` on and off."""
    for count in rows:
        x = torch.randn(count, native.shape[1], generator=torch.Generator().manual_seed(count))
        both = []
        for on in (True, False):
            switch(on)
            both.append(native.kernel_linear(x))
        assert torch.equal(*both), count


@needs_kernels
@pytest.mark.skipif(
    not torch.ops.aserve_cpu.amx_tiles(None) if native_kernels() else True,
    reason="this CPU (or build) has no AMX integer tiles",
)
@pytest.mark.parametrize(
    "qtype", [QType.Q4_0, QType.Q4_K, QType.Q6_K, QType.IQ4_NL, QType.Q5_K], ids=str
)
def test_amx_tiles_give_the_vnni_tiles_bits(qtype: QType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 16 rows of 4-bit codes, level bytes and split codes (groups of 32 and 16) go
    through AMX's integer tiles: every row count's products, the rows and panels left to
    the VNNI tiles included, are bit for bit those without."""
    monkeypatch.setattr(native_module, "blas_rows", lambda weight: NEVER)
    codes = decode(torch.from_numpy(random_blocks(qtype, 104, 512, seed=9)), qtype, 512)
    try:
        same_bits_either_way(
            NativeWeight(codes), torch.ops.aserve_cpu.amx_tiles, (16, 17, 40, 64, 100)
        )
    finally:
        torch.ops.aserve_cpu.amx_tiles(True)


@needs_kernels
def test_a_process_settles_one_row_prefetch_once_at_its_first_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first weight a process makes decides (or reads) the setting and sets it in the
    kernels; later weights leave it. `time_prefetch` times the weight's format streamed at
    `STREAM_SHAPE` both ways."""
    decided: list[Path] = []

    def decide(folder: Path, timer: Callable[[], tuple[float, float]]) -> bool:
        decided.append(folder)
        return False

    def weight() -> NativeWeight:
        blocks = random_blocks(QType.Q4_K, 16, 256)
        return NativeWeight(decode(torch.from_numpy(blocks), QType.Q4_K, 256))

    settled = torch.ops.aserve_cpu.one_row_prefetch(None)
    monkeypatch.setattr(native_module, "decide_one_row_prefetch", decide)
    monkeypatch.setattr(native_module, "_one_row_prefetch", {})
    try:
        torch.ops.aserve_cpu.one_row_prefetch(True)
        made = weight()
        assert torch.ops.aserve_cpu.one_row_prefetch(None) is False
        torch.ops.aserve_cpu.one_row_prefetch(True)
        weight()
        assert torch.ops.aserve_cpu.one_row_prefetch(None) is True and len(decided) == 1
        monkeypatch.setattr(native_module, "STREAM_SHAPE", (1024, 512))
        ahead_ms, plain_ms = native_module.time_prefetch(made)
        assert ahead_ms > 0 and plain_ms > 0
    finally:
        torch.ops.aserve_cpu.one_row_prefetch(settled)


@pytest.mark.parametrize("panels", [1, 5, 8, 13, 24])
def test_scales_lie_in_blocks_of_panels_as_the_kernels_read_them(panels: int) -> None:
    """`in_blocks` puts a panel's values of a unit where `Weight::spot` finds them (scales,
    offsets and bases): each run of eight panels unit-major, the last run holding the
    panels left; `out_of_blocks` gives the panel order back."""
    for rest in [(LANES,), (2, LANES)]:
        values = torch.randn(panels, 6, *rest, generator=torch.Generator().manual_seed(panels))
        kept = in_blocks(values)
        assert kept.shape == values.shape
        assert torch.equal(out_of_blocks(kept), values)
        flat, width = kept.reshape(-1), int(torch.Size(rest).numel())
        for panel in range(panels):
            first = panel - panel % 8
            count = min(8, panels - first)
            for unit in range(6):
                at = (first * 6 + unit * count + panel % 8) * width
                assert torch.equal(flat[at : at + width].view(rest), values[panel, unit])


@needs_kernels
def test_timing_a_format_multiplies_its_panels_and_groups_repeated() -> None:
    """`time_products` times a weight of `SAMPLE_SHAPE` made of a weight's own panels and
    groups (repeated, or the first ones kept), on both paths: those products are the
    weight's, its outputs repeated and each the sum of the weight's over the repeated
    inputs."""
    codes = decode(torch.from_numpy(random_blocks(QType.Q4_K, 100, 256, seed=4)), QType.Q4_K, 256)
    native = NativeWeight(codes)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    halves = [half.contiguous() for half in x.chunk(2, dim=1)]
    first = native.kernel_linear(halves[0])  # 104 outputs: 13 panels, the last padded
    both = first + native.kernel_linear(halves[1])
    expected = both.repeat(1, 3)[:, :240]
    sample = native.resized(30, 512)
    tolerance = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(sample.kernel_linear(x), expected, rtol=0, atol=tolerance)
    torch.testing.assert_close(sample._blas_linear(x), expected, rtol=0, atol=tolerance)
    assert torch.equal(native.resized(4, 256).kernel_linear(halves[0]), first[:, :32])
    kernels_ms, blas_ms = native_module.time_products(native, rows=16)
    assert kernels_ms > 0 and blas_ms > 0


@needs_kernels
def test_each_product_kind_is_decided_once_and_never_with_dot_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the kernels multiply with integer dot products (VNNI, ARM's `sdot`), BLAS takes
    no product, without timing the two: the kernels keep a token's bits exact across batches
    and cache hits. Elsewhere (AVX2 without VNNI, which rounds every code width too, or no
    integer tiles) the timing decides, once for each product kind: weights of one format
    share the first one's choice, and another format is timed on its own."""
    decided: list[str] = []

    def decide(folder: Path, kind: str, timer: Callable[[int], tuple[float, float]]) -> int:
        decided.append(kind)
        return 256

    def weight(qtype: QType) -> NativeWeight:
        return NativeWeight(decode(torch.from_numpy(random_blocks(qtype, 8, 256)), qtype, 256))

    monkeypatch.setattr(native_module, "decide_blas_rows", decide)
    for dot_products, expected in ((True, NEVER), (False, 256)):
        monkeypatch.setattr(native_module, "_blas_rows", {})
        monkeypatch.setattr(native_module, "dot_products", lambda d=dot_products: d)
        made = [weight(q) for q in (QType.Q4_1, QType.Q4_K, QType.Q8_0)]
        assert [w.blas_from for w in made] == [expected] * 3, dot_products
    assert decided == ["codes4", "codes8"]


@needs_kernels
def test_blas_multiplies_the_activations_as_the_kernels_round(blas_from_128: None) -> None:
    """A product handed to BLAS takes the activations the kernels would multiply (rounded to
    16 bits where they round them), so that the two paths differ only in float32's last bits:
    a block with one large input rounds the others by up to ~1.5% of a small one's size."""
    codes = decode(torch.from_numpy(random_blocks(QType.Q4_K, 64, 256, seed=3)), QType.Q4_K, 256)
    weight, native = codes.dequantize().double(), NativeWeight(codes)
    x = torch.randn(BLAS_FROM, 256, generator=torch.Generator().manual_seed(1))
    x[:, ::32] *= 1000
    blas = native.linear(x, None).double()
    reference = F.linear(as_the_kernels_round(x, native), weight)
    largest = float(reference.abs().max())
    torch.testing.assert_close(blas, reference, rtol=0, atol=1e-6 * largest)
    if native.rounds_activations():
        assert float((blas - F.linear(x.double(), weight)).abs().max()) > 1e-5 * largest


@needs_kernels
def test_without_blas_every_row_count_keeps_a_rows_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernels take every product (a CPU where BLAS is the slower), a row's output
    has the same bits alone and in a batch of 300, and matches float64 (of the activations
    as the kernels round them)."""
    monkeypatch.setattr(native_module, "blas_rows", lambda weight: NEVER)
    codes = decode(torch.from_numpy(random_blocks(QType.Q4_K, 72, 512, seed=2)), QType.Q4_K, 512)
    native = NativeWeight(codes)
    x = torch.randn(300, 512, generator=torch.Generator().manual_seed(12))
    together = native.linear(x, None)
    exact = F.linear(as_the_kernels_round(x, native), codes.dequantize().double())
    torch.testing.assert_close(
        together.double(), exact, rtol=0, atol=1e-5 * float(exact.abs().max())
    )
    for row in (0, 131, 299):
        assert torch.equal(native.linear(x[row : row + 1], None)[0], together[row])


@needs_kernels
def test_experts_of_mixed_scale_widths_and_offsets_stack_without_changing_a_product() -> None:
    """`ExpertStack` of one expert with float32 scales and no offsets and one with float16
    scales and offsets: stacked in float32 with zero offsets for the first, each expert's
    products (now views of the stack) the same bits as before."""
    generator = torch.Generator().manual_seed(5)
    rows, cols, group = 24, 64, 32

    def expert(half: bool, offsets: bool) -> NativeWeight:
        scales = torch.rand(rows, cols // group, generator=generator) + 0.5
        scales = scales.half().float() if half else scales + 1e-4
        shifts = -4 * scales if offsets else torch.zeros_like(scales)  # not centred (-8)
        codes = torch.randint(0, 16, (rows, cols), generator=generator, dtype=torch.uint8)
        return NativeWeight(Codes(codes, scales, shifts, group, 4))

    weights = [expert(half=False, offsets=False), expert(half=True, offsets=True)]
    assert [w.scales.dtype for w in weights] == [torch.float32, torch.float16]
    assert [w.offsets.numel() > 0 for w in weights] == [False, True]
    x = torch.randn(3, cols, generator=generator)
    before = [w.linear(x, None) for w in weights]
    stack = ExpertStack(weights)
    assert stack.scales.dtype == torch.float32 and stack.offsets.shape == stack.scales.shape
    assert not stack.offsets[0].any()
    after = [w.linear(x, None) for w in weights]
    assert all(map(torch.equal, before, after))
    assert weights[1].words.data_ptr() == stack.words[1].data_ptr()


@needs_kernels
def test_experts_in_scale_steps_stack_as_steps_or_widen_beside_others() -> None:
    """Q4_K experts keep their int8 steps and bases in the stack; beside a Q4_1 expert
    (float16 scales) every expert's scales are stacked as float32 values. Each expert's
    products keep their bits either way."""
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(6))

    def expert(qtype: QType, seed: int) -> NativeWeight:
        return NativeWeight(
            decode(torch.from_numpy(random_blocks(qtype, 24, 512, seed)), qtype, 512)
        )

    for qtypes, dtype in (
        ((QType.Q4_K, QType.Q4_K), torch.int8),
        ((QType.Q4_K, QType.Q4_1), torch.float32),
    ):
        weights = [expert(qtype, seed) for seed, qtype in enumerate(qtypes)]
        before = [w.linear(x, None) for w in weights]
        stack = ExpertStack(weights)
        assert stack.scales.dtype == dtype
        assert stack.bases.numel() == (0 if dtype == torch.float32 else 2 * 3 * 2 * 2 * 8)
        assert all(torch.equal(w.linear(x, None), b) for w, b in zip(weights, before))


@needs_kernels
def test_gate_up_product_and_its_activation_in_one_call(blas_from_128: None) -> None:
    """`NativeWeight.silu` (gate|up product, SiLU and multiply in one call of the kernels)
    gives the bits of the product then ATen's SiLU and multiply, at every row count the
    kernels take; for BLAS's rows it leaves the steps to the caller."""
    inter = 44  # 88 rows: 11 panels, none padded
    codes = decode(
        torch.from_numpy(random_blocks(QType.Q4_K, 2 * inter, 512, seed=9)), QType.Q4_K, 512
    )
    native = NativeWeight(codes)
    x = torch.randn(BLAS_FROM, 512, generator=torch.Generator().manual_seed(10))
    for rows in (1, 3, 20):
        gate, up = native.linear(x[:rows], None).chunk(2, dim=-1)
        together = native.silu(x[:rows])
        assert together is not None and torch.equal(together, F.silu(gate).mul_(up)), rows
    assert native.silu(x) is None


OTHER_BUILD_FORMATS = (
    QType.Q4_1,
    QType.Q8_0,
    QType.Q4_K,
    QType.Q6_K,
    QType.IQ4_XS,
    QType.IQ4_NL,
    QType.Q3_K,
    QType.Q2_K,
    QType.IQ2_XS,
    QType.IQ1_S,
)


def other_build_operands(qtype: QType) -> tuple[Codes, torch.Tensor]:
    """A weight and rows of x that `OTHER_BUILD_CHECK` multiplies in another build's process."""
    codes = decode(torch.from_numpy(random_blocks(qtype, 100, 512, seed=3)), qtype, 512)
    return codes, torch.randn(70, 512, generator=torch.Generator().manual_seed(9))


OTHER_BUILD_CHECK = """
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from aserve.quant import native
from aserve.quant.gguf import decode

# cpu_decode.cpp only calls the other files' ops (no arithmetic of its own): left out, it
# saves a quarter of the build
arithmetic = [source for source in native.SOURCES if source.name != "cpu_decode.cpp"]
flags = [*sys.argv[2:], *native.openmp_flags()]
native.load_kernels(Path(sys.argv[1]), flags, sources=arithmetic)
# only now: these find the kernels loaded (as built above) instead of building their own
from tests.test_cpu_ops import other_build_attention_operands, reference_attention
from tests.test_quant import (
    FLOAT_DTYPES, OTHER_BUILD_FORMATS, as_the_kernels_round, float_operands, other_build_operands,
    random_blocks,
)
products = {}
for qtype in OTHER_BUILD_FORMATS:
    codes, x = other_build_operands(qtype)
    weight = native.NativeWeight(codes)
    # the activations as this build multiplies them: rounded to 16 bits where it has AVX-VNNI
    exact = F.linear(as_the_kernels_round(x, weight), codes.dequantize().double())
    together = weight.linear(x, None)
    error = float((together.double() - exact).abs().max() / exact.abs().max())
    assert error < 5e-6, (qtype, error)
    for rows in (1, 3, 5, 20):
        assert torch.equal(weight.linear(x[7 : 7 + rows], None), together[7 : 7 + rows]), rows
    products[qtype.name] = (weight.rounds_activations(), together, weight.code_bits)
in_registers = native.keeps_three_bits()
torch.save((products, in_registers), Path(sys.argv[1]) / "products.pt")
# float weights: one chain of FMAs an output in input order, on every build
floats = []
for dtype, (x, weight) in zip(FLOAT_DTYPES, float_operands(), strict=True):
    kept = native.FloatWeight(weight.to(dtype))
    together = kept.kernel_linear(x)
    exact = x.double() @ weight.to(dtype).double().T
    assert float((together[:, : weight.shape[0]].double() - exact).abs().max()) < 1e-3, dtype
    for rows in (1, 3, 5):
        assert torch.equal(kept.kernel_linear(x[7 : 7 + rows].contiguous()), together[7 : 7 + rows])
    floats.append(together)
torch.save(floats, Path(sys.argv[1]) / "floats.pt")
pool = torch.randn(1024, 2, 2, 64, generator=torch.Generator().manual_seed(10))
table = torch.randperm(1024, generator=torch.Generator().manual_seed(11)).to(torch.int32)
table, lens, q = table.view(2, 512), [300, 9], torch.randn(2, 4, 64)
rows, lengths = torch.tensor([0, 1]), torch.tensor(lens)
out = torch.ops.aserve_cpu.decode_attention(q, pool, table, rows, lengths, 0.125)
torch.testing.assert_close(out, reference_attention(q, pool, table, [0, 1], lens))
attended = [torch.ops.aserve_cpu.decode_attention(*c) for c in other_build_attention_operands()]
torch.save(attended, Path(sys.argv[1]) / "attention.pt")
# a MoE layer: the experts' products read their tokens' rows of x in place
experts, hidden, inter = 4, 256, 64
def random_part(qtype, rows, cols, seed):
    return decode(torch.from_numpy(random_blocks(qtype, rows, cols, seed=seed)), qtype, cols)
parts = [
    [random_part(qtype, rows, cols, e) for e in range(experts)]
    for qtype, rows, cols in ((QType.Q4_K, 2 * inter, hidden), (QType.Q8_0, hidden, inter))
]
stacks = [native.ExpertStack([native.NativeWeight(codes) for codes in part]) for part in parts]
floats = [[codes.dequantize().double() for codes in part] for part in parts]
seeded = torch.Generator().manual_seed(12)  # unseeded draws had put the error past 1e-4
router = torch.randn(experts, hidden, generator=seeded) / 16
x = torch.randn(20, hidden, generator=seeded)
together = native.moe_layer(x, router, 2, True, *stacks, inter)
weights, ids = torch.softmax(x @ router.T, -1).topk(2)
weights = weights / weights.sum(-1, keepdim=True)
expected = torch.zeros(20, hidden, dtype=torch.float64)
for t in range(20):
    for j in range(2):
        e = int(ids[t, j])
        gate_up = x[t].double() @ floats[0][e].T
        act = F.silu(gate_up[:inter]) * gate_up[inter:]
        expected[t] += float(weights[t, j]) * (act @ floats[1][e].T)
error = float((together.double() - expected).abs().max() / expected.abs().max())
assert error < 1e-4, error
assert torch.equal(native.moe_layer(x[5:6], router, 2, True, *stacks, inter)[0], together[5])
print("checked")
"""


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def float_operands() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Activations and a float32 weight (rounded to each of `FLOAT_DTYPES` in turn) for the
    float weights' products in two builds."""
    generator = torch.Generator().manual_seed(3)
    return [
        (torch.randn(20, 256, generator=generator), torch.randn(200, 256, generator=generator))
        for _ in FLOAT_DTYPES
    ]


def changes_the_build(flags: list[str]) -> bool:
    """Whether `flags` turn off something that -march=native turns on here: the compiler's
    predefined macros differ (on a CPU without AVX-512, -mno-avx512f changes nothing)."""

    def macros(extra: list[str]) -> str:
        command = [os.environ.get("CXX", "c++"), "-march=native", *extra, "-dM", "-E", "-x", "c++"]
        return subprocess.run(
            [*command, os.devnull], capture_output=True, text=True, check=True
        ).stdout

    return macros([]) != macros(flags)


@needs_kernels
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize(
    "flags",
    [["-mno-avx512f"], ["-mno-avx512f", "-mno-avxvnni"], ["-mno-avx2"]],
    ids=["without-avx512", "without-avx512-or-avx-vnni", "without-avx2"],
)
def test_kernels_built_for_older_cpus_give_the_same_products(
    tmp_path: Path, flags: list[str]
) -> None:
    """The kernels pick their code paths when they compile (-march=native): a CPU without
    AVX-512 runs the 8-lane tiles, with AVX-VNNI (Intel's since Alder Lake) the integer ones
    (`int_tile`), else integer ones too (`vpmaddubsw`, and `vpmaddwd` for levels and 8-bit
    codes) or, with integers turned off, float ones and, from 16 rows, the expanded-codes
    buffer; one without AVX2 the portable tiles. Built here with those instruction sets
    turned off (in a process of their own, the op names being global), every path against
    float64 of the activations as that build rounds them, a row's bits the same alone and
    batched, and the decode attention against its float64 softmax and, with AVX2, bit for bit
    this build's."""
    if not changes_the_build(flags):
        pytest.skip(
            f"this CPU has nothing that {' '.join(flags)} turns off: that build is this one, "
            "which every other test here runs"
        )
    result = subprocess.run(
        [sys.executable, "-c", OTHER_BUILD_CHECK, str(tmp_path), *flags],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0 and "checked" in result.stdout, result.stderr[-3000:]
    # float weights: every build's tiles (the portable ones too) run one fused multiply-add
    # chain an output in input order, so the bits are this build's
    for (x, weight), dtype, theirs in zip(
        float_operands(), FLOAT_DTYPES, torch.load(tmp_path / "floats.pt"), strict=True
    ):
        assert torch.equal(FloatWeight(weight.to(dtype)).kernel_linear(x), theirs), dtype
    if "-mno-avx2" in flags:
        return  # the portable tiles leave the order of a row's float sums to the compiler
    # the decode attention: the same operations on eight lanes in one order, with or without
    # AVX-512 (whose 16-lane weighted sums add each output in the same order)
    theirs = torch.load(tmp_path / "attention.pt")
    for case, their_out in zip(other_build_attention_operands(), theirs, strict=True):
        assert torch.equal(torch.ops.aserve_cpu.decode_attention(*case), their_out)
    # an x86 build without AVX-512 gives this build's bits wherever both round activations or
    # neither does (here turned off to match): per output the same integers and the same
    # float operations in one order
    compared = 0
    kept, in_registers = torch.load(tmp_path / "products.pt")
    # 2- and 3-bit codes keep three bits where that build widens them in registers (with
    # AVX-VNNI), with levels (Q3_K) or without (Q2_K); IQ1 and IQ2_XS keep entries of their
    # book on every build
    three_bits = {q for q, (_, _, bits) in kept.items() if bits == 3}
    assert three_bits == ({"Q2_K", "Q3_K"} if in_registers else set())
    assert {q for q, (_, _, bits) in kept.items() if bits == 2} == {"IQ2_XS", "IQ1_S"}
    if "-mno-avxvnni" in flags:
        assert not three_bits
    for qtype, (rounds, theirs, _) in kept.items():
        codes, x = other_build_operands(QType[qtype])
        weight = NativeWeight(codes)
        try:
            torch.ops.aserve_cpu.int_activations(rounds)
            if rounds == weight.rounds_activations():
                assert torch.equal(weight.linear(x, None), theirs), qtype
                compared += 1
        finally:
            torch.ops.aserve_cpu.int_activations(True)
    assert compared == len(OTHER_BUILD_FORMATS)


def test_a_moe_part_decoded_at_once_splits_and_joins_expert_by_expert() -> None:
    """Every expert's gate (and up) decoded as one weight of all their rows: `split_rows`
    gives each expert's rows, `interleave_blocks` each expert's gate rows then its up rows
    (the fused kernels' gate|up); weights of different formats do not join."""
    experts, rows = 3, 4

    def part(kind: QType, seed: int) -> Codes:
        raw = random_blocks(kind, experts * rows, 64, seed=seed)
        return decode(torch.from_numpy(raw), kind, 64)

    gate, up = part(QType.Q4_0, 1), part(QType.Q4_0, 2)
    dense_gate, dense_up = gate.dequantize(), up.dequantize()
    for expert, piece in enumerate(gate.split_rows(experts)):
        assert torch.equal(piece.dequantize(), dense_gate[expert * rows : (expert + 1) * rows])
    joined = gate.interleave_blocks(up, experts)
    for expert, piece in enumerate(joined.split_rows(experts)):
        mine = slice(expert * rows, (expert + 1) * rows)
        assert torch.equal(piece.dequantize(), torch.cat([dense_gate[mine], dense_up[mine]]))
    with pytest.raises(ValueError, match="only weights of one group size"):
        gate.interleave_blocks(part(QType.Q8_0, 3), experts)


def test_moe_experts_of_different_formats_decode_one_by_one() -> None:
    """A layer whose experts are stored in two formats (GGUF keeps one a stacked tensor, but
    a file may split them) loads each expert on its own and multiplies as its float twin."""
    from aserve.distributed.group import TPGroup
    from aserve.layers.moe import QuantizedExperts, route, torch_experts
    from aserve.quant.native import Scratch

    num_experts, hidden, inter = 2, 64, 32
    experts = QuantizedExperts(num_experts, hidden, inter, TPGroup(), fused=False)
    kinds = [QType.Q4_0, QType.Q8_0]
    dense: dict[str, list[torch.Tensor]] = {"gate": [], "up": [], "down": []}
    for expert, kind in enumerate(kinds):
        for seed, (name, rows, cols) in enumerate(
            [("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)]
        ):
            raw = torch.from_numpy(random_blocks(kind, rows, cols, seed=10 * expert + seed))
            experts.load_tensor(f"{expert}.{name}_proj.weight", QuantizedTensor(raw, kind, cols))
            dense[name].append(decode(raw, kind, cols).dequantize())
    experts.finalize(torch.device("cpu"), torch.float32, Scratch())
    assert experts.stacked is None
    w13 = torch.cat([torch.stack(dense["gate"]), torch.stack(dense["up"])], 1)
    w2 = torch.stack(dense["down"])
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)) / 8
    weights, ids = route(torch.randn(5, num_experts), 1, renormalize=True)
    expected = torch_experts(x.double(), w13.double(), w2.double(), weights.double(), ids)
    out = experts(x, weights, ids).double()
    # 16-bit activations (`rounds_activations`) move it by ~1.2e-4 of the largest output
    torch.testing.assert_close(out, expected, rtol=0, atol=5e-4 * float(expected.abs().max()))


@needs_kernels
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_kernels_round_activations_to_16_bits_a_block_where_the_cpu_has_vnni(qtype: QType) -> None:
    """On CPUs with VNNI (AVX-512's or AVX-VNNI), on other AVX2 CPUs (`vpmaddubsw`,
    `vpmaddwd`) or with ARM's dot products (`sdot`, checked under QEMU by
    scripts/arm-qemu-tests.sh) the kernels multiply codes by activations rounded to
    16-bit integers a block of 32 inputs: within float32 rounding of the float64 product of
    exactly those activations, at every tile shape (1, 3, 5, 9 rows: tiles of 3 or 4 rows, 2
    and 1; 100 outputs, the last panel alone), and measurably apart from the unrounded
    product; turned off, the float32 tiles match the unrounded one. A row keeps its bits
    alone and batched."""
    native = NativeWeight(
        decode(torch.from_numpy(random_blocks(qtype, 100, 512, seed=5)), qtype, 512)
    )
    if not native.rounds_activations():
        pytest.skip(
            "this CPU has no AVX2 integer tiles, AVX-512 VNNI or ARM dot products (with AVX-512, "
            "5- and 6-bit codes also need its VBMI): the kernels multiply float32 activations"
        )
    weight = native.rows(torch.arange(100)).double()
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(6))
    x[2, 40] = 300.0  # one block's steps widened; the row's other blocks keep theirs
    exact = F.linear(x.double(), weight)
    rounded = F.linear(as_the_kernels_round(x, native), weight)
    tight = 2e-6 * float(exact.abs().max())
    for rows in (1, 3, 5, 9):
        got = native.linear(x[:rows], None).double()
        torch.testing.assert_close(got, rounded[:rows], rtol=0, atol=tight)
        assert torch.equal(got[:1], native.linear(x[:1], None).double())
    assert float((native.linear(x, None).double() - exact).abs().max()) > 4 * tight
    try:
        torch.ops.aserve_cpu.int_activations(False)
        assert not native.rounds_activations()
        torch.testing.assert_close(native.linear(x, None).double(), exact, rtol=0, atol=tight)
    finally:
        torch.ops.aserve_cpu.int_activations(True)
