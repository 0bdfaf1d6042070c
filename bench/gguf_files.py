"""Writing random GGUF files for benchmarks (bench/dense_gguf.py, bench/moe_gguf.py): the
embedded model's tokenizer, matrices in a block format, and the file itself."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TOKENIZER_FIELDS = ("model", "pre", "tokens", "token_type", "merges")


def copy_tokenizer(writer: gguf.GGUFWriter) -> int:
    """The embedded model's vocabulary into `writer`; its size."""
    from aserve.models.gguf_header import read_header
    from aserve.models.source import embedded_gguf

    metadata = read_header(embedded_gguf()).metadata
    read = {name: metadata[f"tokenizer.ggml.{name}"] for name in TOKENIZER_FIELDS}
    writer.add_tokenizer_model(read["model"])
    writer.add_tokenizer_pre(read["pre"])
    writer.add_token_list(read["tokens"])
    writer.add_token_types(read["token_type"])
    writer.add_token_merges(read["merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return len(read["tokens"])


def write_out(writer: gguf.GGUFWriter, out: Path) -> None:
    """The header, metadata and tensors into the file, and its size printed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)")


RANDOM_BLOCK_FORMATS = (
    *("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS"),
)
"""llama.cpp's formats of levels, which the `gguf` package does not quantize: written as
random blocks (their one float16 a block set to scale them)."""


def random_blocks(
    qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rms: float, rng: np.random.Generator
) -> np.ndarray:
    """`[rows, bytes]` of random blocks of a codebook format whose weights have about `rms`."""
    size, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    set_block_scales(raw, qtype, np.ones((rows, cols // size, 1), np.float16))
    sample = gguf.quants.dequantize(raw[: min(rows, 64)].reshape(-1, nbytes), qtype)
    scale = rms / float(np.sqrt(np.mean(np.square(sample))))
    signs = rng.choice(np.array([-1.0, 1.0], np.float32), (rows, cols // size, 1))
    set_block_scales(raw, qtype, (signs * scale).astype(np.float16))
    return raw.reshape(rows, -1)


def set_block_scales(raw: np.ndarray, qtype: gguf.GGMLQuantizationType, d: np.ndarray) -> None:
    """Every block's float16 scale `d` `[rows, blocks, 1]` into `raw` `[rows, blocks, bytes]`:
    its first two bytes, or in IQ1_M four nibbles atop the 16-bit scale fields at 48-55."""
    if qtype.name != "IQ1_M":
        raw[..., 0:2] = d.view(np.uint8)
        return
    nibbles = (d.view(np.uint16) >> np.array([0, 4, 8, 12], np.uint16)) & 15
    fields = raw[..., 48:56].copy().view(np.uint16) & 0x0FFF | nibbles << 12
    raw[..., 48:56] = fields.view(np.uint8)


def random_matrix(
    shape: tuple[int, ...], kind: gguf.GGMLQuantizationType, rng: np.random.Generator
) -> np.ndarray:
    """A `shape` matrix (or stack of them) in `kind` whose weights have a root mean square of
    one over the square root of its inputs: normal weights quantized by the `gguf` package,
    or random blocks of the formats in RANDOM_BLOCK_FORMATS."""
    if kind.name in RANDOM_BLOCK_FORMATS:
        rows = int(np.prod(shape[:-1]))
        blocks = random_blocks(kind, rows, shape[-1], 1 / np.sqrt(shape[-1]), rng)
        return blocks.reshape(*shape[:-1], -1)
    weight = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[-1])
    return gguf.quants.quantize(weight, kind)
