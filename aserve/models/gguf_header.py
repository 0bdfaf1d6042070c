"""A GGUF file's header, read in one pass: its metadata and where each tensor's data lies.

gguf's `GGUFReader` makes a numpy view of every value it parses; a vocabulary and its
merges are ~100,000 strings, and the embedded model's header took it 5.5 s of a first
start (on a 2-core VM). Read here with `struct` from the mapped file, the same header takes
a fraction of a second. The layout (versions 2 and 3, little-endian) is the one
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md describes: magic, version, tensor
count, metadata count, the metadata's typed key/value pairs, each tensor's name, dimensions,
type and offset, then the data from the next multiple of `general.alignment`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
# Tensor types whose data is a view of their own element type; the others are rows of
# block bytes (as gguf's reader gives them, and gguf_weights.py expects).
ELEMENT_DTYPES = {
    gguf.GGMLQuantizationType.F32: np.dtype("<f4"),
    gguf.GGMLQuantizationType.F16: np.dtype("<f2"),
    gguf.GGMLQuantizationType.F64: np.dtype("<f8"),
    gguf.GGMLQuantizationType.I8: np.dtype("i1"),
    gguf.GGMLQuantizationType.I16: np.dtype("<i2"),
    gguf.GGMLQuantizationType.I32: np.dtype("<i4"),
    gguf.GGMLQuantizationType.I64: np.dtype("<i8"),
}


class GGUFHeaderError(ValueError):
    """The file is no GGUF that this reader takes, or it ends before its header says."""


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    # Per tensor: name, type, shape (GGUF's order), offset in the file, and the numpy dtype
    # and dims of its data: what a converted folder's gguf.json keeps.
    table: list[dict[str, Any]]


class _Cursor:
    """Reads values one after another from the mapped file, refusing to run past its end."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.at = 0

    def take(self, size: int) -> int:
        start = self.at
        if size < 0 or start + size > len(self.buffer):
            raise GGUFHeaderError("the file ends inside its header")
        self.at += size
        return start

    def unpack(self, form: str) -> Any:
        return struct.unpack_from(form, self.buffer, self.take(struct.calcsize(form)))[0]

    def string(self) -> str:
        size = self.unpack("<Q")
        start = self.take(size)
        return self.buffer[start : start + size].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.unpack(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GGUFHeaderError(f"unknown metadata value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in SCALARS:  # numbers in one go: a vocabulary's scores and types
            dtype = np.dtype(SCALARS[item_kind])
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.buffer, dtype, count, start).tolist()
        return [self.value(item_kind) for _ in range(count)]


def read_header(path: Path) -> GGUFHeader:
    """The metadata (numbers as Python numbers, arrays as lists) and the tensor table.
    Raises GGUFHeaderError for what is no whole GGUF file: another format or version, a
    header cut short, an unknown tensor type, or tensor data past the file's end."""
    with path.open("rb") as file:
        if path.stat().st_size < len(MAGIC):  # mmap refuses an empty file
            raise GGUFHeaderError("the file is shorter than a GGUF's magic number")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _parse(buffer)


def _parse(buffer: mmap.mmap) -> GGUFHeader:
    cursor = _Cursor(buffer)
    if buffer[: len(MAGIC)] != MAGIC:
        raise GGUFHeaderError("it does not start with GGUF's magic number")
    cursor.take(len(MAGIC))
    version = cursor.unpack("<I")
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        order = "a big-endian file, " if swapped in VERSIONS else ""
        raise GGUFHeaderError(f"{order}GGUF version {version}; versions 2 and 3 are read")
    tensor_count, metadata_count = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = [_tensor_info(cursor) for _ in range(tensor_count)]
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFHeaderError(f"general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.at // alignment) * alignment
    table, names = [], set()
    for name, shape, kind, offset in infos:
        if name in names:
            raise GGUFHeaderError(f"tensor {name} appears twice")
        names.add(name)
        entry, nbytes = _table_entry(name, shape, kind, data_start + offset)
        if entry["offset"] + nbytes > len(buffer):
            raise GGUFHeaderError(f"tensor {name}: the file ends inside its data")
        table.append(entry)
    return GGUFHeader(metadata, table)


def _tensor_info(cursor: _Cursor) -> tuple[str, list[int], gguf.GGMLQuantizationType, int]:
    name = cursor.string()
    shape = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
    raw_kind = cursor.unpack("<I")
    try:
        kind = gguf.GGMLQuantizationType(raw_kind)
    except ValueError:
        raise GGUFHeaderError(f"tensor {name} has unknown type {raw_kind}") from None
    return name, shape, kind, cursor.unpack("<Q")


def _table_entry(
    name: str, shape: list[int], kind: gguf.GGMLQuantizationType, offset: int
) -> tuple[dict[str, Any], int]:
    """Where the data lies and how to view it (float and integer tensors as their elements,
    block formats as rows of bytes: the innermost dimension counted in bytes), and its size."""
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    dims = list(reversed(shape))
    elements = int(np.prod(shape, dtype=np.int64))
    if kind in ELEMENT_DTYPES:
        dtype = ELEMENT_DTYPES[kind]
        nbytes = elements * dtype.itemsize
    else:
        if not shape or shape[0] % block:
            raise GGUFHeaderError(f"tensor {name}'s rows are not whole {kind.name} blocks")
        dtype = np.dtype(np.uint8)
        dims[-1] = shape[0] // block * block_bytes
        nbytes = elements // block * block_bytes
    entry = {
        "name": name,
        "type": int(kind),
        "shape": shape,
        "offset": offset,
        "dtype": dtype.str,
        "dims": dims,
    }
    return entry, nbytes
