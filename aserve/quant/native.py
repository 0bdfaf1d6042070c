"""aserve's CPU kernels for quantized weights (csrc/cpu_kernels.cpp), compiled on first use.

PyTorch's own kernels were measured first, on the project's 2-core AVX2 box, SmolLM2-135M
shapes, us per product at 1 / 16 / 128 rows against float32 MKL-packed weights (gate_up,
3072 x 576; `python bench/quant_kernels.py` times every shape of the model):
- `_weight_int4pack_mm_for_cpu`: 146 / 1,098 / 8,440 with bfloat16 activations (1,818 at one
  row with float32 ones, a scalar path), against MKL's 180 / 888 / 3,722; it reads GGUF's
  4-bit groups, but not its 8-bit ones, and rounds scales to bfloat16.
- `_weight_int8pack_mm` and fbgemm's dynamic int8 linear: one scale per output row, which
  GGUF's groups of 16 or 32 do not fit without changing the weights.
The kernels here keep GGUF's groups exactly, expand the codes to float32 in registers and
multiply float32 activations, with one order of operations per output whatever the batch
(a first version rounded activations to int8 as llama.cpp does, and radix-cache hits changed
greedy tokens). On CPUs with AVX-512 VNNI or AVX-VNNI they round each row's activations to
16-bit integers a block of 32 inputs instead and multiply the codes as bytes (`vpdpbusd`:
with AVX-512 1.4x faster at one row and 1.5x at 128 on a Zen 5 VM, with AVX-VNNI's 256 bits
1.6-2.0x at one row and 1.1-1.2x at 128; `rounds_activations`), as on other AVX2 CPUs (4-bit
and split codes by `vpmaddubsw`, 1.8x at one row; levels and 8-bit codes as 16-bit integers by
`vpmaddwd`, 1.9-2.3x at one row, 1.1-1.4x at 127) and on 64-bit ARM CPUs with the
dot-product instructions for every code width (`sdot`: Apple's M cores, Graviton 2 and newer,
Cortex-A76 and newer; checked for bits under QEMU, not timed on an ARM CPU); a row's integers
depend on the row alone, the CPU attention computes every query the same way whether its
prefix was cached or not (attention/torch_native.py), and where the kernels multiply with
dot-product instructions (VNNI, ARM's `sdot`) BLAS is not used (`blas_rows`), so neither
batches nor cache hits change a token's bits. Where BLAS is the faster for many rows
(`blas_rows`: measured once per CPU and code format; about 2x at 512 to 2,048 rows on that
box for 4-bit codes, slower than the kernels on AMD's AVX-512 cores, and on levels and 8-bit
codes on an AVX2-only AMD EPYC), products from that many rows (prefill chunks, large decode
batches) de-quantize slices of the weight into a reused buffer and BLAS multiplies them (with
the activations as the kernels round them, where they do), different from the kernels only
in the last bits of float32, like any two float32 products (the float path has the same
between a cached and an uncached prefix).

They build with torch's C++ extension loader (a C++ compiler and ninja) into aserve's cache,
15-50 s the first time on two cores, then load in milliseconds. Where that fails the caller
falls back to float32 weights (aserve/quant/cpu.py) and says so once.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch

from aserve.config import PLAIN_EXPERTS, ExpertStyle, cache_root
from aserve.quant.codes import Codes, Runs, ScaleSteps, groups_of_at_most_32, level_bytes
from aserve.quant.huge_pages import WeightBlocks

logger = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("cpu_kernels.cpp", "cpu_float.cpp", "cpu_attention.cpp", "cpu_decode.cpp")
]
LANES = 8  # output features per panel: one AVX2 register of float32
SCALE_BLOCK = 8
"""Panels whose scales, offsets and bases the kernels keep interleaved (`in_blocks`)."""
FLOAT_WORDS = (torch.bfloat16, torch.float16, torch.float32)
"""Weights that `FloatWeight` keeps as they are for the kernels."""
BLAS_ROWS = (128, 256, 512)
"""The row counts from which a code format's products may go to BLAS (`blas_rows`): BLAS
pays for de-quantizing the weight once a call, so its lead over the kernels grows with the
rows, and the least of these where it leads is where it takes over."""
NEVER = sys.maxsize
BLAS_SLICE_BYTES = 2 << 20
BLAS_WHOLE_BYTES = 32 << 20
"""A weight whose float32 form fits this goes to BLAS whole, in one product that writes the
output; slices each copy their columns into it, which cost 12% of a nomic-embed-text-shaped
encoder's prefill at ~4,000 rows (9.4 against 10.9 s a draw, 2-core Xeon). Larger ones (a
big model's, its LM head) go in slices of BLAS_SLICE_BYTES."""
SAMPLE_SHAPE = (1024, 2048)
"""The weight that `time_products` times a format on, outputs by inputs: large enough that
BLAS's de-quantization weighs as in a model's products (over 256 inputs the kernels lost to
BLAS at 512 rows on levels where over 2,048 they won), small enough to time in a second."""
_blas_rows: dict[str, int] = {}
"""This process's `blas_rows` a `product_kind`, decided when a weight of it is first made."""
STREAM_SHAPE = (32768, 4096)
"""The weight that `time_prefetch` streams, outputs by inputs: 80-140 MB in the kernels' code
formats, past a CPU's last-level cache as a model's weights are at each decode step."""
_one_row_prefetch: dict[str, bool] = {}
"""This process's `one_row_prefetch` (under "on"), decided when its first weight is made."""


class Scratch:
    """The float32 buffer where a model's products expand slices of codes for BLAS, kept
    between calls and shared by them all (a model runs one product at a time); it grows to
    the largest slice asked for, at most BLAS_WHOLE_BYTES."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def take(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel)
        return self.buffer[:numel]


@cache
def native_kernels() -> bool:
    """Whether `torch.ops.aserve_cpu` is loaded, building it once if it must. Cached for
    the process: the answer cannot change while it runs."""
    if hasattr(torch.ops, "aserve_cpu") and hasattr(torch.ops.aserve_cpu, "decode_attention"):
        return True
    folder = kernels_folder()
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not build_kernels(folder):
        return False
    logger.info("CPU kernels ready in %.1f s (%s)", time.perf_counter() - started, folder)
    return True


ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
"""This CPU's instruction sets as GCC and clang name them on x86, as clang names them on ARM
(some of Apple's compilers refuse -march=native), then none: the kernels' portable tiles."""


def build_kernels(folder: Path) -> bool:
    """Build and load the kernels with the first flags that work: this CPU's instruction sets
    (`ARCH_FLAGS` in turn), with OpenMP threads where torch runs on OpenMP, else one thread.
    False, with a warning, where none builds (no C++ compiler)."""
    threading = openmp_flags()
    thread_options = [threading, []] if threading else [[]]
    attempts = [(arch, threads) for arch in ARCH_FLAGS for threads in thread_options]
    first_error = ""
    for arch, threads in attempts:
        try:
            load_kernels(folder, threads, arch)
        except Exception as error:
            if not first_error:
                first_error = str(error).splitlines()[0] if str(error) else type(error).__name__
            continue
        if (arch, threads) != attempts[0]:
            logger.warning(
                "CPU kernels built with %s after the first try failed (%s)",
                " ".join([*arch, *threads]) or "no CPU-specific flags",
                first_error,
            )
        return True
    logger.warning(
        "aserve's CPU kernels did not build (%s): quantized weights are de-quantized to "
        "float32 instead; install a C++ compiler and ninja to keep them quantized",
        first_error,
    )
    return False


def kernels_folder() -> Path:
    return cache_root() / "kernels" / build_kind()


def product_kind(weight: KernelTensors) -> str:
    """The kernels' family of tiles for `weight`'s products: its code width as kept, and
    whether codes stand for levels (book entries count as 2-bit levels); float weights by
    their format."""
    if weight.words.is_floating_point():
        return str(weight.words.dtype).removeprefix("torch.")
    return f"{'levels' if weight.levels is not None else 'codes'}{weight.code_bits}"


def blas_rows(weight: NativeWeight) -> int:
    """From how many rows products of `weight`'s format (`product_kind`) go to BLAS, or never
    (`NEVER`), on this CPU: measured when a weight of the format is first made here
    (`decide_blas_rows`) and kept in the kernels' folder. It depends on the format and on
    the CPU's maker as much as on its instruction sets: on a 2-core AVX2 box BLAS was ~2x
    faster for 4-bit codes from 512 rows, on an AVX2-only AMD EPYC it lost to the kernels
    on levels (IQ4_XS) and 8-bit codes at 128 to 1,024 rows and won on split codes (Q6_K)
    from 64, and MKL runs its AVX2 code on AMD's AVX-512 cores, where the kernels were 1.4x
    faster than BLAS at 64 to 2,048 rows (Zen 5). Without BLAS every output has the same bits
    whatever its batch. On CPUs with integer dot products (AVX-512 VNNI, AVX-VNNI or ARM's
    `sdot`: `dot_products`), never: with VNNI the kernels were the faster, and they keep a
    token's bits exact across batches and cache hits (on ARM that choice is made for the
    bits; BLAS was not timed there); float weights (`FloatWeight`), which those
    instructions do not multiply, are timed there too. Elsewhere BLAS takes the activations
    as the kernels round them where they do (every code width on AVX2,
    `rounded_like_the_kernels`), so the two paths differ in float32's last bits, not by a
    rounding step."""
    kind = product_kind(weight)
    if kind not in _blas_rows:
        _blas_rows[kind] = (
            NEVER
            if dot_products() and not weight.words.is_floating_point()
            else decide_blas_rows(kernels_folder(), kind, lambda rows: time_products(weight, rows))
        )
    return _blas_rows[kind]


@cache
def kernels_version() -> str:
    """A short hash of the kernels' sources: a choice measured with other kernels (an older
    aserve in the same folder) is measured again."""
    digest = hashlib.sha1()
    for source in SOURCES:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def kept_answer(kept: Path, key: str, measure: Callable[[], dict[str, Any]]) -> Any:
    """`key` of a measured answer that these kernels keep at `kept`, or of `measure()`'s
    answer, kept there now. The first process to keep an answer wins and every later one reads
    it, so the ranks of a tensor-parallel run that measure at once still take one path (a MoE
    layer's routing must not differ between them). An answer measured with other kernels (an
    older aserve in the same folder), or unreadable, is measured again."""
    try:
        record = json.loads(kept.read_text())
        if record["kernels"] == kernels_version():
            return record[key]
        kept.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        kept.unlink(missing_ok=True)
    record = {**measure(), "kernels": kernels_version()}
    mine = kept.with_name(f"{kept.stem}.{os.getpid()}.json")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        mine.write_text(json.dumps(record))
        with contextlib.suppress(FileExistsError):
            os.link(mine, kept)
        mine.unlink()
        return json.loads(kept.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError):  # a read-only cache: this answer, unkept
        return record[key]


def decide_blas_rows(folder: Path, kind: str, timer: Callable[[int], tuple[float, float]]) -> int:
    """`blas_rows` of a product kind as kept in `folder` by these kernels, or measured now
    and kept there (`kept_answer`): `timer(rows)` gives the kernels' and BLAS's milliseconds
    for a product of `rows` rows, asked for each of `BLAS_ROWS` from the largest down until
    the kernels are the faster."""

    def measure() -> dict[str, Any]:
        rows, timings = NEVER, {}
        for candidate in sorted(BLAS_ROWS, reverse=True):
            kernels_ms, blas_ms = timer(candidate)
            timings[candidate] = [kernels_ms, blas_ms]
            if blas_ms >= kernels_ms:
                break
            rows = candidate
        logger.info(
            "%s products, CPU kernels / BLAS ms by rows: %s; BLAS %s",
            kind,
            ", ".join(f"{r}: {k:.2f} / {b:.2f}" for r, (k, b) in timings.items()),
            "never" if rows == NEVER else f"from {rows} rows",
        )
        return {"kind": kind, "blas_rows": rows, "ms": timings}

    return int(kept_answer(folder / f"blas_rows.{kind}.json", "blas_rows", measure))


def settle_one_row_prefetch(weight: NativeWeight) -> None:
    """Whether this CPU's one-row products ask for their next panels ahead (`one_row_prefetch`
    in cpu_kernels.cpp; tiles of more rows always ask), set once a process: as kept in the
    kernels' folder, else decided by `decide_one_row_prefetch` on `weight`'s format (the first
    a process makes). The requests change no bits, only time, and which way is the faster
    depends on the CPU: on a Xeon they had won ~14% of a decode step, on an AMD EPYC with
    AVX-512 they cost ~13%."""
    if "on" not in _one_row_prefetch:
        on = decide_one_row_prefetch(kernels_folder(), lambda: time_prefetch(weight))
        _one_row_prefetch["on"] = torch.ops.aserve_cpu.one_row_prefetch(on)


def decide_one_row_prefetch(folder: Path, timer: Callable[[], tuple[float, float]]) -> bool:
    """Panels asked ahead unless `timer()`'s one-row products without (its second figure,
    milliseconds) beat those with them (its first), as kept in `folder` (`kept_answer`)."""

    def measure() -> dict[str, Any]:
        ahead_ms, plain_ms = timer()
        on = ahead_ms <= plain_ms
        logger.info(
            "one-row CPU products %.2f ms with panels asked ahead, %.2f ms without: %s",
            ahead_ms,
            plain_ms,
            "asking ahead" if on else "leaving it to the CPU's prefetchers",
        )
        return {"one_row_prefetch": on, "ms": [ahead_ms, plain_ms]}

    return bool(kept_answer(folder / "one_row_prefetch.json", "one_row_prefetch", measure))


def time_prefetch(weight: NativeWeight) -> tuple[float, float]:
    """Milliseconds of a one-row product of `weight`'s format streamed from memory
    (`STREAM_SHAPE`: its panels and groups repeated), with the next panels asked ahead and
    without, the best of four each, taken in turn (`time_products` says why). The setting it
    leaves is `settle_one_row_prefetch`'s to make."""
    outputs, cols = STREAM_SHAPE
    sample = weight.resized(outputs // LANES, cols)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(0))

    def product(ahead: bool) -> None:
        torch.ops.aserve_cpu.one_row_prefetch(ahead)  # microseconds against milliseconds
        sample.kernel_linear(x)

    return best_in_turns(lambda: product(True), lambda: product(False))


def time_products(weight: NativeWeight, rows: int) -> tuple[float, float]:
    """Milliseconds of one product of `rows` rows on the kernels and on BLAS, the best of
    four each, taken in turn (a shared VM's speed moves by up to 2x within seconds: three of
    one path, then three of the other, had kept opposite choices for one format in two
    builds), on `weight`'s panels and groups repeated or cut to `SAMPLE_SHAPE`: the first
    weight of a format that a model makes may be a small one."""
    outputs, cols = SAMPLE_SHAPE
    sample = weight.resized(outputs // LANES, cols)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    return best_in_turns(lambda: sample.kernel_linear(x), lambda: sample._blas_linear(x))


def best_in_turns(first: Callable[[], object], second: Callable[[], object]) -> tuple[float, float]:
    """The best milliseconds of four calls each of `first` and `second`, taken in turn after
    one call each to warm them up (`time_products` says why in turn)."""
    paths = (first, second)
    best = [float("inf"), float("inf")]
    for turn in range(5):
        for i, path in enumerate(paths):
            started = time.perf_counter()
            path()
            if turn:
                best[i] = min(best[i], (time.perf_counter() - started) * 1e3)
    return best[0], best[1]


def load_kernels(
    folder: Path,
    flags: list[str],
    arch: tuple[str, ...] = ARCH_FLAGS[0],
    sources: list[Path] = SOURCES,
) -> None:
    """Build `sources` for this CPU (`arch` flags, and `flags` added to the compile and link)
    into `folder` if they are not built there yet, and load them as `torch.ops.aserve_cpu`."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name="aserve_cpu",
        sources=[str(source) for source in sources],
        extra_cflags=["-O3", *arch, *flags],
        extra_ldflags=flags,
        build_directory=str(folder),
        is_python_module=False,
    )


def openmp_flags(platform: str = sys.platform, torch_folder: Path | None = None) -> list[str]:
    """Compile and link flags that give the kernels torch's OpenMP runtime where torch runs
    its parallel loops on it: compiled without, `at::parallel_for` in the kernels is a plain
    loop on the calling thread, and every product ran on one core (two threads took the time
    of one, bench/NOTES.md). On Linux `-fopenmp` (GCC's runtime, which torch loads). Apple's
    compilers take no `-fopenmp`, and torch's macOS wheels are built on OpenMP too, so there
    the preprocessor is asked for it and the kernels link the `libomp` that torch ships and
    loads (with its `omp.h`): one runtime, torch's threads. Elsewhere none."""
    if not torch._C.has_openmp:
        return []
    if platform.startswith("linux"):
        return ["-fopenmp"]
    folder = torch_folder or Path(torch.__file__).parent
    lib = folder / "lib"
    if (
        platform == "darwin"
        and (lib / "libomp.dylib").exists()
        and (folder / "include" / "omp.h").exists()
    ):
        return ["-Xpreprocessor", "-fopenmp", f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"]
    return []


def build_kind() -> str:
    """The kernels' cache folder name: one build per CPU, torch and Python installation. The
    build links the torch and Python it was made with and its build file names their paths;
    two environments sharing one folder (a venv beside the system Python) rebuilt it at every
    switch, 8 s each on a laptop."""
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    install = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:8]
    return f"cpu-{platform.machine()}-{_cpu_features()}-torch{torch.__version__}-{python}-{install}"


def _cpu_features() -> str:
    """A short hash of the CPU's feature flags: the kernels build with -march=native, so a
    cache shared by machines of different CPUs (a network home) keeps one build per kind."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else platform.processor()
    flags = next((line for line in text.splitlines() if line.startswith("flags")), text)
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


def rounds_activations(code_bits: int) -> bool:
    """Whether products of codes kept in `code_bits` (2, 3, 4, 6 or 8, as `NativeWeight` keeps
    them) round activations to 16-bit integers on this CPU (csrc/cpu_kernels.cpp,
    `IntActivations`); False where the kernels do not build."""
    return native_kernels() and bool(torch.ops.aserve_cpu.int_activations(None, code_bits))


def dot_products() -> bool:
    """Whether the kernels multiply with integer dot-product instructions here (AVX-512 VNNI,
    AVX-VNNI, ARM's `sdot`)."""
    return native_kernels() and bool(torch.ops.aserve_cpu.dot_products())


def keeps_three_bits() -> bool:
    """Whether `NativeWeight` keeps 2- and 3-bit codes (standing for levels, or not) in
    three bits here: where the kernels widen them in registers as they multiply, about as
    fast as nibbles (the integer tiles with AVX-512 VNNI or AVX-VNNI, csrc/cpu_kernels.cpp).
    Elsewhere slower than nibbles, so nibbles."""
    return native_kernels() and bool(torch.ops.aserve_cpu.three_bit_in_registers())


def rounded_like_the_kernels(rows: torch.Tensor) -> torch.Tensor:
    """Float32 `rows` as the kernels round them where they multiply integers
    (`rounds_activations`): each block of 32 inputs to whole steps of its largest magnitude
    / 32,639 (csrc/cpu_kernels.cpp, `quantize_block`), for BLAS to multiply the same values."""
    count, cols = rows.shape
    blocks = torch.nn.functional.pad(rows, (0, -cols % 32)).view(count, -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 32639.0 / largest, torch.zeros_like(largest))
    steps = torch.round(blocks * inverse)
    return (steps * (largest / 32639.0)).view(count, -1)[:, :cols]


def compact_scales(
    scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and offsets in the fewest bytes that keep every value exactly, so the products
    give the same bits: float16 where all survive the round trip (GGUF stores them in float16
    for Q4_0, Q4_1, Q5_x, Q8_0 and IQ4), else float32 (K-quants' scales are a float16 times
    a 6-bit integer), and no offsets where all are zero (symmetric formats). At one row the
    products are bound by reading the weight: Q4_1 takes 20 bytes a group of 32, not 24."""
    half_scales, half_offsets = scales.half(), offsets.half()
    if torch.equal(half_scales.float(), scales) and torch.equal(half_offsets.float(), offsets):
        scales, offsets = half_scales, half_offsets
    if not offsets.any():
        offsets = offsets.new_empty(0)
    return scales, offsets


def panel_steps(
    steps: ScaleSteps, offsets: torch.Tensor, panels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A format's `ScaleSteps` in the kernels' layout: int8 steps of the scales and offsets
    `[panels, groups, 8]` (offsets empty where all are zero) and their float16 bases
    `[panels, blocks, 2, 8]` (the scales' base, then the offsets'); None where offsets are
    stored but not as steps, or a base is not a float16 (GGUF's are). Step times base is the
    scale itself, so the products keep their bits: Q4_K reads 0.58 bytes a weight instead of
    0.75 with float32 scales (the file's 0.56; 0.59 with float32 bases, which cost a 1B
    Q4_K_M file's products 2.5% more bytes)."""
    stored = bool(offsets.any())
    if stored and steps.offset_steps is None:
        return None
    if not all(
        torch.equal(bases.half().float(), bases)
        for bases in (steps.scale_bases, steps.offset_bases)
        if bases is not None
    ):
        return None

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [rows, n] -> [panels, n, 8]
        return t.view(panels, LANES, -1).transpose(1, 2).contiguous()

    scale_bases = lanes(steps.scale_bases)
    offset_bases = torch.zeros_like(scale_bases)
    offset_steps = torch.empty(0, dtype=torch.int8)
    if stored:
        assert steps.offset_steps is not None and steps.offset_bases is not None
        offset_steps, offset_bases = lanes(steps.offset_steps), lanes(steps.offset_bases)
    bases = torch.stack([scale_bases, offset_bases], 2).half()
    return lanes(steps.scale_steps), offset_steps, bases


def in_blocks(values: torch.Tensor) -> torch.Tensor:
    """Per-panel values `[panels, units, ...]` (scales, offsets: units are groups; bases:
    blocks of groups) in the kernels' order, the same shape: each run of `SCALE_BLOCK`
    panels unit-major, `[units, panels of the run, ...]`, the last run holding what panels
    are left (`Weight::spot` in csrc/cpu_kernels.cpp). A one-row product then reads a tile's
    scales as one stream, where each panel's apart made 24 streams that the CPU's
    prefetchers did not keep up with."""
    if not values.numel():
        return values
    panels, rest = values.shape[0], values.shape[2:]
    whole = panels - panels % SCALE_BLOCK
    runs = values[:whole].reshape(whole // SCALE_BLOCK, SCALE_BLOCK, values.shape[1], *rest)
    parts = [runs.transpose(1, 2).reshape(-1), values[whole:].transpose(0, 1).reshape(-1)]
    return torch.cat(parts).view(values.shape)


def out_of_blocks(values: torch.Tensor) -> torch.Tensor:
    """`in_blocks` undone: per-panel values `[panels, units, ...]` in panel order."""
    if not values.numel():
        return values
    panels, units, rest = values.shape[0], values.shape[1], values.shape[2:]
    whole = panels - panels % SCALE_BLOCK
    flat = values.reshape(-1)
    split = whole * units * int(torch.Size(rest).numel())
    runs = flat[:split].view(whole // SCALE_BLOCK, units, SCALE_BLOCK, *rest).transpose(1, 2)
    left = flat[split:].view(units, panels - whole, *rest).transpose(0, 1)
    return torch.cat([runs.reshape(whole, units, *rest), left]).contiguous()


class KernelTensors:
    """What the kernels' ops take of a weight (one, or a stack of experts): its words, scales,
    offsets and bases, then its code format."""

    words: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    bases: torch.Tensor
    group: int
    code_bits: int
    levels: torch.Tensor | None
    blas_from: int
    """Products of this many rows and more go to BLAS (`blas_rows`)."""

    def rounds_activations(self) -> bool:
        """Whether the kernels multiply these codes by activations rounded to 16-bit
        integers on this CPU (`rounds_activations`)."""
        return rounds_activations(self.code_bits)

    def kernel_args(self) -> tuple[object, ...]:
        return (
            self.words,
            self.scales,
            self.offsets,
            self.bases,
            self.group,
            self.code_bits,
            self.levels,
        )

    def move_to(self, blocks: WeightBlocks) -> None:
        """Keep the tensors in `blocks` (on huge pages) from now on: the same values."""
        self.words, self.scales = blocks.place(self.words), blocks.place(self.scales)
        self.offsets, self.bases = blocks.place(self.offsets), blocks.place(self.bases)


class NativeWeight(KernelTensors):
    """A weight in the kernels' panel layout (csrc/cpu_kernels.cpp), in groups of 16 or 32:
    codes of up to 4 bits eight to a word (with their 16 levels where they stand for levels),
    5 and 6 bits as such a nibble plus words of two bits an input (`code_bits` 6), wider ones
    signed, four to a word; codes of 2 and 3 bits (Q2_K, Q3_K), where `keeps_three_bits`, in
    three bits, a pair of groups' low two bits 16 to a word then their high bits 32 to a
    word (`code_bits` 3, `three_bit_words`), which the kernels widen to nibbles as they
    multiply; runs of 8 inputs that are entries of their format's book (IQ1, IQ2, IQ3_XXS:
    `Runs`) as those 16- or 24-bit entries (`code_bits` 2) where they are smaller than the
    codes, which the kernels look up as they multiply; scales and offsets as
    `compact_scales` keeps them, or as int8 steps and float16 bases (`panel_steps`), each
    in blocks of panels (`in_blocks`)."""

    def __init__(self, codes: Codes, scratch: Scratch | None = None) -> None:
        self.scratch = scratch or Scratch()
        self.shape = codes.shape
        codes = groups_of_at_most_32(codes).centered()
        self.group = codes.group
        # 5- and 6-bit codes as a nibble and two bits (8-bit words: 1.06 bytes a Q6_K weight
        # against the file's 0.82); wider ones a byte each; 2- and 3-bit codes in 3 bits where
        # groups pair up and the kernels widen them in registers (a Q3_K weight 0.47 bytes
        # with its scales, not 0.59 as nibbles); book entries in 2 (an IQ2_XXS weight 0.31 bytes
        # with its scales, not 0.44 in 3 bits; the file's 0.26)
        rows, cols = codes.shape
        three = codes.bits <= 3 and (cols // codes.group) % 2 == 0 and keeps_three_bits()
        self.code_bits = 3 if three else 4 if codes.bits <= 4 else 6 if codes.bits <= 6 else 8
        # book entries where they take fewer bits than the codes (IQ2_S's 24 bits a run of 8
        # match three-bit codes, which multiply faster)
        runs = codes.runs
        if runs is not None and runs.entry_bits // 8 >= self.code_bits:
            runs = None
        if runs is not None:
            self.code_bits = 2
        self.levels = None
        if runs is not None:
            self.levels = runs.kernel_book
        elif self.code_bits < 8 and codes.table is not None:
            self.levels = level_bytes(codes.table[:16])
        self.padded = padded = -(-rows // LANES) * LANES
        codes = codes.pad_rows(padded)
        runs = codes.runs if runs is not None else None
        values, scales, offsets = codes.codes, codes.scales, codes.offsets
        if self.code_bits == 8:
            values, offsets = codes.signed()
        panels, groups = padded // LANES, cols // self.group

        def packed(fields: torch.Tensor) -> torch.Tensor:
            """Fields [panel, lane, unit, word, field] (uint8 or int8, each under 2**(32 /
            fields a word)) as int32 words [panel, unit, word, lane], field i of a word at bits
            i * 32 / (fields a word)."""
            fields = fields.permute(0, 2, 3, 1, 4)  # [panel, unit, word, lane, field]
            width = 32 // fields.shape[-1]
            while fields.shape[-1] > 4:  # pairs of fields into one, until a byte each
                fields = fields[..., 0::2] | fields[..., 1::2] << width
                width *= 2
            return fields.contiguous().view(torch.int32).squeeze(-1)

        def words_of(codes: torch.Tensor, per_word: int) -> torch.Tensor:
            """Codes [rows, cols] as int32 words [panel, group, word, lane], per_word a word."""
            return packed(codes.view(panels, LANES, groups, self.group // per_word, per_word))

        def three_bit_words(codes: torch.Tensor) -> torch.Tensor:
            """Codes under 8 as int32 words [panel, pair of groups, word, lane]: the pair's low
            two bits, 16 inputs a word with inputs k and k + 8 of the 16 in nibble k, then its
            high bits, 32 inputs a word with input 8j + k of the 32 at bit 4k + j. A nibble word
            of the 4-bit layout is then two shifts, two masks and an or away (`widen_three`)."""
            pairs, pair = groups // 2, 2 * self.group
            low = (codes & 3).view(panels, LANES, pairs, pair // 16, 2, 8)
            high = (codes >> 2).view(panels, LANES, pairs, pair // 32, 4, 8)
            low_nibbles = low[..., 0, :] | low[..., 1, :] << 2
            high_nibbles = high[..., 0, :] | high[..., 1, :] << 1
            high_nibbles |= high[..., 2, :] << 2 | high[..., 3, :] << 3
            return packed(torch.cat([low_nibbles, high_nibbles], 3))

        def entry_words(runs: Runs) -> torch.Tensor:
            """Entries [rows, cols / 8] as int32 words [panel, group, bytes], ordered [run,
            lane] in each group, each in its 2 or 3 bytes, least significant first."""
            entries = runs.entries.view(panels, LANES, groups, self.group // 8)
            entries = entries.permute(0, 2, 3, 1)[..., None]
            size = runs.entry_bits // 8
            fields = (entries >> (8 * torch.arange(size, dtype=torch.int32))) & 255
            return fields.to(torch.uint8).reshape(panels, groups, -1).view(torch.int32)

        if runs is not None:
            if runs.entries.numel() and int(runs.entries.max()) >= runs.entry_limit:
                raise ValueError("book entries past the end of their book")
            self.words = entry_words(runs)
        elif self.code_bits == 8:
            self.words = words_of(values, 4)
        elif self.code_bits == 3:
            self.words = three_bit_words(values)
        elif self.code_bits == 4:
            self.words = words_of(values, 8)
        else:  # a group's nibble words, then its words of high bits
            self.words = torch.cat([words_of(values & 15, 8), words_of(values >> 4, 16)], 2)
        self.scales, self.offsets = compact_scales(
            scales.view(panels, LANES, groups).transpose(1, 2).contiguous(),
            offsets.view(panels, LANES, groups).transpose(1, 2).contiguous(),
        )
        self.bases = torch.empty(0)
        if codes.steps is not None and self.scales.dtype == torch.float32:
            stepped = panel_steps(codes.steps, offsets, panels)
            if stepped is not None:
                self.scales, self.offsets, self.bases = stepped
        self.scales, self.offsets = in_blocks(self.scales), in_blocks(self.offsets)
        self.bases = in_blocks(self.bases)
        self.blas_from = blas_rows(self)
        settle_one_row_prefetch(self)

    @property
    def nbytes(self) -> int:
        return self.words.nbytes + self.scales.nbytes + self.offsets.nbytes + self.bases.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        plain = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        rows = x if plain else x.reshape(-1, x.shape[-1]).float().contiguous()
        blas = rows.shape[0] >= self.blas_from
        out = self._blas_linear(rows) if blas else self.kernel_linear(rows)
        if plain and bias is None and self.padded == self.shape[0]:
            # a decoder's own case, as it is: the slicing, reshape and cast below cost ~2 us
            # a call, a quarter of a millisecond a step of the embedded model
            return out
        if self.padded != self.shape[0]:
            out = out[:, : self.shape[0]]
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.shape[0]).to(x.dtype)

    def kernel_linear(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aserve_cpu.linear(rows, *self.kernel_args())

    def silu(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of a fused gate|up weight (gate rows, then as many up rows) times
        `x`, in one call of the kernels (`gated_linear`: the same bits as `linear` then
        ATen's SiLU and multiply); None where the kernels do not take x whole (BLAS rows,
        other layouts): the caller runs the steps."""
        plain = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
        if not plain or x.shape[0] >= self.blas_from or self.shape[0] % 2:
            return None
        return torch.ops.aserve_cpu.gated_linear(x, *self.kernel_args(), self.shape[0] // 2)

    def _blas_linear(self, rows: torch.Tensor) -> torch.Tensor:
        """Many rows: de-quantize a slice of panels at a time into the scratch buffer (at most
        BLAS_SLICE_BYTES) and let BLAS multiply it, with the activations as the kernels would
        take them."""
        if self.rounds_activations():
            rows = rounded_like_the_kernels(rows)
        panels, cols = self.padded // LANES, self.shape[1]
        whole = 4 * LANES * cols * panels <= BLAS_WHOLE_BYTES
        step = panels if whole else min(panels, max(1, BLAS_SLICE_BYTES // (4 * LANES * cols)))
        if step == panels:
            return rows @ self._dequantize(0, panels)
        out = rows.new_empty(rows.shape[0], panels * LANES)
        for first in range(0, panels, step):
            last = min(panels, first + step)
            out[:, first * LANES : last * LANES] = rows @ self._dequantize(first, last)
        return out

    def resized(self, panels: int, cols: int) -> NativeWeight:
        """A weight of this format with `panels` panels of `cols` inputs (a multiple of its
        super-blocks': 256 does for every GGUF format): this one's panels and groups, repeated
        or cut (to time its format, `time_products`)."""
        groups = self.shape[1] // self.group

        def resized(t: torch.Tensor) -> torch.Tensor:
            """[panels, units, ...] with units (groups, pairs of groups, super-blocks) in
            step with the groups."""
            if not t.numel():
                return t
            units = cols // self.group * t.shape[1] // groups
            t = t.repeat(-(-panels // t.shape[0]), -(-units // t.shape[1]), *[1] * (t.dim() - 2))
            return t[:panels, :units].contiguous()

        def resized_values(t: torch.Tensor) -> torch.Tensor:
            return in_blocks(resized(out_of_blocks(t)))

        sample = copy.copy(self)
        sample.words, sample.scales = resized(self.words), resized_values(self.scales)
        sample.offsets, sample.bases = resized_values(self.offsets), resized_values(self.bases)
        sample.shape = torch.Size([panels * LANES, cols])
        sample.padded, sample.scratch = panels * LANES, Scratch()
        return sample

    def _dequantize(self, first: int, last: int) -> torch.Tensor:
        cols, width = self.shape[1], (last - first) * LANES
        out = self.scratch.take(cols * width).view(cols, width)
        torch.ops.aserve_cpu.dequantize(*self.kernel_args(), first, out)
        return out

    def plain_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales and offsets as values: kept ones as they are, steps times their bases (in
        the kernels' order, `in_blocks`, as kept)."""
        if self.scales.dtype != torch.int8:
            return self.scales, self.offsets
        groups, blocks = self.scales.shape[1], self.bases.shape[1]
        bases = out_of_blocks(self.bases).repeat_interleave(groups // blocks, 1)
        scales = in_blocks(out_of_blocks(self.scales).float() * bases[:, :, 0].float())
        offsets = self.offsets
        if offsets.numel():
            offsets = in_blocks(out_of_blocks(offsets).float() * bases[:, :, 1].float())
        return scales, offsets.float()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` de-quantized (embedding lookups): the same values the products use."""
        return torch.ops.aserve_cpu.rows(*self.kernel_args(), ids)


class FloatWeight(NativeWeight):
    """A float weight for the kernels (csrc/cpu_float.cpp) to multiply float32 activations by:
    bfloat16 or float16 kept in its two bytes a value and widened in registers (the float32
    weight's products, widening being exact, from half its bytes, which a one-row product is
    bound by), or float32 as it is (MKL's few-row products read it at a third of the
    memory's speed on AMD CPUs). `words` is `[panels, cols, 8]`, each panel's 8 outputs side
    by side input by input; no scales. Every op of the quantized weights takes it (`linear`,
    `silu`, `rows`, BLAS for many rows through `_dequantize`, the C++ decode stack), except
    the expert groups."""

    def __init__(self, weight: torch.Tensor, scratch: Scratch | None = None) -> None:
        assert weight.dtype in FLOAT_WORDS and weight.dim() == 2
        self.scratch = scratch or Scratch()
        rows, cols = weight.shape
        self.shape = torch.Size([rows, cols])
        self.padded = -(-rows // LANES) * LANES
        padded = torch.nn.functional.pad(weight, (0, 0, 0, self.padded - rows))
        self.words = padded.view(-1, LANES, cols).transpose(1, 2).contiguous()
        self.scales = self.offsets = self.bases = torch.empty(0)
        self.group, self.code_bits, self.levels = cols, 8 * weight.element_size(), None
        self.blas_from = blas_rows(self)

    def rounds_activations(self) -> bool:
        return False

    def resized(self, panels: int, cols: int) -> FloatWeight:
        """A weight of this format of `panels` panels by `cols` inputs, this one's values
        repeated or cut (`time_products`)."""
        words = self.words.repeat(-(-panels // self.words.shape[0]), -(-cols // self.shape[1]), 1)
        sample = copy.copy(self)
        sample.words = words[:panels, :cols].contiguous()
        sample.shape = torch.Size([panels * LANES, cols])
        sample.group, sample.padded, sample.scratch = cols, panels * LANES, Scratch()
        return sample


def one_format(weights: list[NativeWeight]) -> bool:
    """Whether `linear_group` can take these weights in one call: the same code format (not
    floats, which it does not take)."""
    first = weights[0]
    return not first.words.is_floating_point() and all(
        w.group == first.group
        and w.code_bits == first.code_bits
        and (w.levels is None) == (first.levels is None)
        and (w.levels is None or torch.equal(w.levels, first.levels))
        for w in weights
    )


def kernel_weights(weights: list[NativeWeight]) -> tuple[object, ...]:
    """Weights of `one_format` as the kernels' list ops take them: their words, scales,
    offsets and bases, then the format they share."""
    first = weights[0]
    return (
        [w.words for w in weights],
        [w.scales for w in weights],
        [w.offsets for w in weights],
        [w.bases for w in weights],
        first.group,
        first.code_bits,
        first.levels,
    )


def linear_group(weights: list[NativeWeight], xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """`weights[i].linear(xs[i], None)` for every i in one call of the kernels, one parallel
    region for all (the same outputs, bit for bit): weights of `one_format`, each x float32,
    contiguous and of fewer than their `blas_from` rows."""
    outs = torch.ops.aserve_cpu.linear_group(xs, *kernel_weights(weights))
    return [
        out if w.padded == w.shape[0] else out[:, : w.shape[0]]
        for w, out in zip(weights, outs, strict=True)
    ]


class ExpertStack(KernelTensors):
    """A MoE layer's experts of one part (every gate|up, or every down) as one tensor each of
    words, scales, offsets and bases, expert-major, so that a decode step hands the whole
    layer to the kernels in a few tensors (handing them 128 experts' tensors one by one cost
    ~80 us a call). The experts' own `NativeWeight`s become views of the stack: the bytes are
    held once. Scales kept in steps (`panel_steps`) stay so where every expert's are; else
    scales of mixed kinds are stacked in float32, and offsets that some experts leave out as
    zeros: the same values, so the same products."""

    def __init__(self, weights: list[NativeWeight]) -> None:
        assert one_format(weights), "one stack holds experts of one code format"
        first = weights[0]
        self.group, self.code_bits, self.levels = first.group, first.code_bits, first.levels
        self.blas_from = first.blas_from
        self.words = torch.stack([w.words.reshape(-1) for w in weights])
        stepped = all(
            w.scales.dtype == torch.int8 and w.bases.shape == first.bases.shape for w in weights
        )
        if stepped:
            parts = [(w.scales, w.offsets) for w in weights]
            self.bases = torch.stack([w.bases for w in weights])
        else:
            parts = [w.plain_scales() for w in weights]
            self.bases = torch.empty(0)
        kinds = {scales.dtype for scales, _ in parts}
        dtype = kinds.pop() if len(kinds) == 1 else torch.float32
        self.scales = torch.stack([scales.to(dtype) for scales, _ in parts])
        if any(offsets.numel() for _, offsets in parts):
            self.offsets = torch.stack(
                [
                    offsets.to(dtype) if offsets.numel() else torch.zeros_like(scales, dtype=dtype)
                    for scales, offsets in parts
                ]
            )
        else:
            self.offsets = self.scales.new_empty(0)
        self.experts = weights
        self._lend_to_experts()

    def _lend_to_experts(self) -> None:
        """Each expert's tensors as views of the stack's."""
        for e, weight in enumerate(self.experts):
            weight.words = self.words[e].view(weight.words.shape)
            weight.scales = self.scales[e]
            weight.offsets = self.offsets[e] if self.offsets.numel() else self.offsets
            weight.bases = self.bases[e] if self.bases.numel() else self.bases

    def move_to(self, blocks: WeightBlocks) -> None:
        super().move_to(blocks)
        self._lend_to_experts()


def moe_layer(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    renormalize: bool,
    gate_up: ExpertStack,
    down: ExpertStack,
    inter: int,
    router_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    style: ExpertStyle = PLAIN_EXPERTS,
    choice_bias: torch.Tensor | None = None,
    routed_scaling: float = 1.0,
) -> torch.Tensor:
    """A MoE layer for `x`'s tokens in one call of the kernels (`moe_layer` in
    csrc/cpu_kernels.cpp): float32 router logits, softmax, top-k and renormalisation as
    layers/moe.route computes them, then every chosen expert's gate|up (gate rows, then up
    rows; `inter` each), its gate and down, and the routing-weighted sum. For fewer than
    the stacks' `blas_from` tokens, so that no expert gets more rows. gpt-oss's experts add
    the router's bias, each expert's gate|up and down biases (float32; no down biases on
    tensor-parallel ranks after the first) and gate by `style`'s clamped SwiGLU. GLM-4.5's
    route by sigmoid scores, chosen with `choice_bias` and weighed times `routed_scaling`
    (`moe.route_deepseek` in one group)."""
    return torch.ops.aserve_cpu.moe_layer(
        x,
        router,
        top_k,
        renormalize,
        *gate_up.kernel_args(),
        *down.kernel_args(),
        inter,
        router_bias,
        up_bias,
        down_bias,
        style.swiglu_alpha,
        style.swiglu_limit or 0.0,
        choice_bias,
        routed_scaling,
    )
