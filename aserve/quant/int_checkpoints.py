"""Integer checkpoints as they are published: AWQ, GPTQ and compressed-tensors files keep
each linear weight as integer codes with a scale, and a zero point, per group of inputs,
`w = (code - zero) * scale`. Each weight's tensors are joined as they arrive and unpacked
into aserve's one form of quantized weights (quant/codes.py: `code * scale + offset`, the
offset being `-zero * scale`), so these files run on the kernels that run GGUF files, on CPU
and CUDA, and a 4-bit weight stays 4-bit. With fp16 or bf16 scales the offset is exact in
float32 (a zero of at most 8 bits times an 11-bit mantissa), so the unpacked weight is the
file's to the last bit; kernels that keep scales and offsets in float16 round the offset
as GGUF's Q4_1 rounds its minimum.

Each format packs differently (`IntScheme` in config.py says which a checkpoint uses):
- AWQ (AutoAWQ's GEMM layout): `qweight` int32 `[inputs, outputs / 8]`, eight 4-bit codes
  a word along the outputs in the order 0, 2, 4, 6, 1, 3, 5, 7; `qzeros` packed the same,
  `[groups, outputs / 8]`; `scales` `[groups, outputs]`.
- GPTQ: `qweight` `[inputs * bits / 32, outputs]`, codes packed along the inputs from each
  word's lowest bits (2, 3, 4 or 8 bits; 3-bit codes run on across words, 32 in 3 words);
  `qzeros` `[groups, outputs * bits / 32]` along the outputs, stored
  minus one in the first format (the kernels of every engine add it back, so a stored 15 is
  a zero of 16); `scales` `[groups, outputs]`; `g_idx` each input's group.
- compressed-tensors: `weight_packed` `[outputs, inputs * bits / 32]` along the inputs,
  codes offset by 2**(bits - 1); `weight_zero_point` (asymmetric schemes) packed along the
  outputs, `[outputs * bits / 32, groups]`; `weight_scale` `[outputs, groups]`;
  `weight_shape` the unpadded shape. Its int-quantized format keeps int8 values in `weight`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from aserve.config import ConfigError, IntScheme
from aserve.layers.weight import read_whole
from aserve.quant.codes import Codes

AWQ_NIBBLE_OF_OUTPUT = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])
"""Where AWQ puts output j of a word's eight: nibble AWQ_NIBBLE_OF_OUTPUT[j % 8]."""

PARTS = {
    "awq": (".qweight", ".qzeros", ".scales"),
    "gptq": (".qweight", ".qzeros", ".scales"),
    "pack-quantized": (".weight_packed", ".weight_scale", ".weight_shape"),
    "int-quantized": (".weight", ".weight_scale"),
}
"""The tensors of one weight in each layout, its codes first (asymmetric compressed-tensors
schemes add `.weight_zero_point`, act-order ones the group index)."""
GROUP_INDEX = (".g_idx", ".weight_g_idx")
DROPPED = (".input_scale", ".input_zero_point")
"""Static activation scales of W8A8 files: aserve keeps activations in 16 bits."""


class CodesTensor:
    """A weight's codes that layers slice like a tensor: a rank's rows, or its columns at
    whole groups (one group a row slices anywhere). An act-order weight's columns are in
    `order` (column j holds input order[j]), so that each group's are consecutive; its
    product gathers its inputs into that order (quant/method.py, `PermutedInputs`). A
    rank's inputs of such a weight hold part of every group: `_act_order_inputs` pads each
    group's share with zero columns, which `order` points at an input past the last
    (`inputs`, a zero the product appends), so `shape` stays the layer's."""

    def __init__(self, codes: Codes, order: torch.Tensor | None = None, inputs: int = 0) -> None:
        self.codes = codes
        self.order = order
        self.inputs = inputs or codes.shape[1]
        self.shape = (codes.shape[0], self.inputs)
        self.device = codes.codes.device

    def __getitem__(self, index: slice | tuple[slice, slice]) -> CodesTensor:
        rows, cols = index if isinstance(index, tuple) else (index, slice(None))
        c = self.codes
        start, stop, _ = cols.indices(self.shape[1])
        if self.order is not None:
            whole = (
                self if (start, stop) == (0, self.shape[1]) else self._act_order_inputs(start, stop)
            )
            c = whole.codes
            kept = c._replace(codes=c.codes[rows], scales=c.scales[rows], offsets=c.offsets[rows])
            return CodesTensor(kept, whole.order, whole.inputs)
        group = c.group
        if group == self.shape[1]:
            group, kept = stop - start, slice(None)
        elif start % group or stop % group:
            raise ConfigError(
                f"columns {start}:{stop} split a group of {group} inputs: use a --tp that "
                "splits the layers at whole groups"
            )
        else:
            kept = slice(start // group, stop // group)
        codes = c.codes[rows, start:stop]
        sliced = Codes(codes, c.scales[rows, kept], c.offsets[rows, kept], group, c.bits)
        return CodesTensor(sliced, self.order)

    def _act_order_inputs(self, start: int, stop: int) -> CodesTensor:
        """This act-order weight's columns of inputs [start, stop), a rank's under tensor
        parallelism: in group order, each group's share padded with columns of code 0 to a
        whole number of kernel groups (32 inputs, or the groups of 16), the pads gathering
        the zero input past the rank's last. Groups of 128 at two ranks grow by about a
        quarter (a group's ~64 inputs a rank take 64 or 96 columns), groups of 32 double;
        vLLM's Marlin reads such uneven groups as they are instead."""
        c = self.codes
        assert self.order is not None
        unit = 32 if c.group % 32 == 0 else c.group
        taken = ((self.order >= start) & (self.order < stop)).nonzero().flatten()
        groups = taken // c.group
        columns, order, group_of = [], [], []
        pad = stop - start  # the appended zero input
        for g in groups.unique().tolist():
            mine = taken[groups == g]
            width = -(-len(mine) // unit) * unit
            columns.append(torch.cat([mine, mine.new_full((width - len(mine),), -1)]))
            order.append(
                torch.cat([self.order[mine] - start, mine.new_full((width - len(mine),), pad)])
            )
            group_of += [g] * (width // unit)
        picked = torch.cat(columns).to(c.codes.device)
        codes = torch.where(picked >= 0, c.codes[:, picked.clamp_min(0)], 0).to(c.codes.dtype)
        per_group = torch.tensor(group_of, device=c.scales.device)
        scales, offsets = c.scales[:, per_group], c.offsets[:, per_group]
        padded = Codes(codes.contiguous(), scales.contiguous(), offsets.contiguous(), unit, c.bits)
        return CodesTensor(padded, torch.cat(order), stop - start)

    def permute_rows(self, order: torch.Tensor) -> CodesTensor:
        c = self.codes
        rows = c._replace(codes=c.codes[order], scales=c.scales[order], offsets=c.offsets[order])
        return CodesTensor(rows, self.order, self.inputs)

    def dequantize(self) -> torch.Tensor:
        """The weight in float32, its columns in the row's own order."""
        weight = self.codes.dequantize()
        if self.order is None:
            return weight
        unpermuted = weight.new_zeros(weight.shape[0], self.inputs + 1)
        unpermuted[:, self.order] = weight  # pads land on the extra column
        return unpermuted[:, : self.inputs]

    def decode(self) -> Codes:
        """The codes, in groups the kernels take: groups wider than 32 inputs must be whole
        multiples of 32 (quant/codes.py's `groups_of_at_most_32`)."""
        c = self.codes
        if c.group > 32 and c.group % 32:
            raise ConfigError(
                f"groups of {c.group} inputs: aserve's kernels take groups of 32 or multiples"
            )
        return c


def pair_int_weights(
    weights: Iterable[tuple[str, Any]], scheme: IntScheme, dequantize: bool
) -> Iterator[tuple[str, Any]]:
    """An integer checkpoint's tensors with each weight's parts joined, whichever order they
    come in: `CodesTensor`s named `{layer}.weight`, or float32 weights with `dequantize`
    (`--quantization none`). Every other tensor passes as it is (biases, norms, the
    embedding and an unquantized LM head). Outside act-order schemes a group index (`g_idx`)
    is checked to describe groups of consecutive inputs, then dropped."""
    layout = scheme.method
    if layout == "compressed-tensors":
        layout = "pack-quantized" if scheme.packed else "int-quantized"
    suffixes = PARTS[layout]
    if layout.endswith("quantized") and not scheme.symmetric:
        suffixes = (*suffixes, ".weight_zero_point")
    if scheme.act_order:
        suffixes = (*suffixes, GROUP_INDEX[layout.endswith("quantized")])
    arrived: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        suffix = next((s for s in suffixes if name.endswith(s)), None)
        if suffix == ".weight" and _dtype(tensor) != "I8":
            suffix = None  # a float weight of a layer left unquantized
        if name.endswith(GROUP_INDEX) and suffix is None:
            _check_group_index(name, read_whole(tensor), scheme.group)
            continue
        if name.endswith(DROPPED):
            continue
        if suffix is None:
            yield name, tensor
            continue
        base = name[: -len(suffix)]
        parts = arrived.setdefault(base, {})
        parts[suffix] = read_whole(tensor)
        if len(parts) == len(suffixes):
            del arrived[base]
            weight = unpack(scheme, [parts[s] for s in suffixes])
            yield f"{base}.weight", weight.dequantize() if dequantize else weight
    if arrived:
        base, parts = next(iter(arrived.items()))
        missing = sorted(set(suffixes) - set(parts))
        raise ConfigError(f"quantized weight {base} lacks {', '.join(missing)} in the checkpoint")


def unpack(scheme: IntScheme, parts: list[torch.Tensor]) -> CodesTensor:
    """One weight's codes from its tensors, in `PARTS` order (an act-order weight's group
    index last: `in_group_order`)."""
    bits = scheme.bits
    if scheme.act_order:
        *parts, index = parts
    if scheme.method == "awq":
        qweight, qzeros, scales = parts
        codes = _awq_order(unpack_words(qweight, 4, 1))
        zeros = _awq_order(unpack_words(qzeros, 4, 1)).t()
        unpacked = _codes(codes.t(), zeros, scales.t(), bits, scheme.group)
    elif scheme.method == "gptq":
        qweight, qzeros, scales = parts
        codes = unpack_words(qweight, bits, 0)
        zeros = unpack_words(qzeros, bits, 1).to(torch.int16)
        if scheme.zeros_less_one:
            zeros += 1
        unpacked = _codes(codes.t(), zeros.t(), scales.t(), bits, scheme.group)
    elif scheme.packed:
        packed, scales, shape, *zero_point = parts
        rows, cols = (int(n) for n in shape.reshape(-1))
        codes = unpack_words(packed, bits, 1)[:, :cols]
        if zero_point:
            zeros = unpack_words(zero_point[0], bits, 0)[:rows]
        else:
            zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int16)
        unpacked = _codes(codes, zeros, scales, bits, scheme.group)
    else:
        values, scales, *zero_point = parts  # int8 values, codes offset by 128
        codes = (values.to(torch.int16) + 128).to(torch.uint8)
        zeros = zero_point[0].to(torch.int16) + 128 if zero_point else torch.full_like(scales, 128)
        unpacked = _codes(codes, zeros.reshape(scales.shape), scales, 8, scheme.group)
    if scheme.act_order:
        return in_group_order(unpacked, index)
    return CodesTensor(unpacked)


def in_group_order(codes: Codes, index: torch.Tensor) -> CodesTensor:
    """An act-order weight whose `index` (`g_idx`) gives each input's group: its columns
    sorted by group (stable), so that each group's are consecutive, with that order; none
    where the index keeps the row's order."""
    index = index.reshape(-1).long()
    order = torch.argsort(index, stable=True)
    group = codes.group
    if not torch.equal(index[order], torch.arange(index.numel()) // group):
        raise ConfigError(f"a group index that does not give each group {group} inputs")
    if torch.equal(order, torch.arange(index.numel())):
        return CodesTensor(codes)
    return CodesTensor(codes._replace(codes=codes.codes[:, order].contiguous()), order)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The uint8 codes of int32 `words`, each word's `32 // bits` codes laid out along `dim`
    in order from its lowest bits; widths that do not divide 32 (GPTQ's 3 bits) run on
    across words, the words along `dim` one stream of bits from each one's lowest."""
    mask = (1 << bits) - 1
    if 32 % bits:
        return _unpack_stream(words, bits, dim)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        fields = (words[:, None, :] >> shifts[None, :, None]) & mask
        return fields.reshape(-1, words.shape[1]).to(torch.uint8)
    fields = (words[:, :, None] >> shifts) & mask
    return fields.reshape(words.shape[0], -1).to(torch.uint8)


def _unpack_stream(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`unpack_words` for a width that does not divide 32: blocks of `lcm(bits, 32)` bits
    (3 words and 32 codes for 3 bits), code i of a block from bit `i * bits` on, in one word
    or the low end of the next."""
    block_bits = math.lcm(bits, 32)
    unsigned = (words.long() & 0xFFFFFFFF).movedim(dim, 0)
    blocks = unsigned.unflatten(0, (-1, block_bits // 32))
    codes = []
    for at in range(0, block_bits, bits):
        word, shift = divmod(at, 32)
        value = blocks[:, word] >> shift
        if shift + bits > 32:
            value |= blocks[:, word + 1] << (32 - shift)
        codes.append((value & ((1 << bits) - 1)).to(torch.uint8))
    return torch.stack(codes, 1).flatten(0, 1).movedim(0, dim)


def _awq_order(unpacked: torch.Tensor) -> torch.Tensor:
    """Columns of unpacked AWQ words put back in output order."""
    outputs = torch.arange(unpacked.shape[1])
    return unpacked[:, outputs - outputs % 8 + AWQ_NIBBLE_OF_OUTPUT[outputs % 8]]


def _codes(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int
) -> Codes:
    """`Codes` of `[rows, cols]` codes with `[rows, groups]` zeros and scales."""
    rows, cols = codes.shape
    group = group or cols
    if cols % group:
        raise ConfigError(f"{cols} inputs do not split into groups of {group}")
    if scales.shape != (rows, cols // group) or zeros.shape != scales.shape:
        raise ConfigError(
            f"scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit "
            f"{rows} x {cols} weights in groups of {group}"
        )
    scales = scales.float()
    offsets = -zeros.float() * scales
    return Codes(codes.contiguous(), scales.contiguous(), offsets.contiguous(), group, bits)


def _check_group_index(name: str, index: torch.Tensor, group: int) -> None:
    """Outside act-order schemes, a group index must say what consecutive groups say."""
    inputs = torch.arange(index.numel())
    expected = inputs // group if group else torch.zeros_like(inputs)
    if not torch.equal(index.reshape(-1).long(), expected):
        raise ConfigError(
            f"{name}: this group index gathers inputs out of order, but the checkpoint's "
            "config says its groups are runs of inputs (desc_act false, or static_groups)"
        )


def _dtype(tensor: Any) -> str:
    """A tensor's safetensors dtype name, whether read or a lazy slice."""
    if isinstance(tensor, torch.Tensor):
        return {torch.int8: "I8"}.get(tensor.dtype, str(tensor.dtype))
    return tensor.get_dtype()
