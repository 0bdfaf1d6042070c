"""One-row FP8 products whose weight is copied into shared memory before the PDL wait.

At batch 1 a layer's small products (the 8B shape's qkv, 25 MB, and o, 17 MB) fit in the
SMs' shared memory (132 x 227 KB on an H100/H200). Here each block copies its rows in with
bulk copies (`cp.async.bulk`, one per row, evict-first in L2) and reads its rows' scales as
soon as it is resident, then waits for the kernel before it (`griddepcontrol.wait`):
launched early under PDL, the o projection's weight streams in while attention runs and
qkv's while the down projection ends, where the Triton GEMV (layers/gemv.py) could hold only
a first tile in registers. After the wait a block reads the input row, multiplies its rows
on the tensor cores (FP8 widened to bf16 bits with bit operations, as `_fp8_words_kernel`
does; the input row in every column of the MMA's B) and adds the warps' parts.

On an H200, a single 8B FP8 + FP8 KV stream (bench/latency.py, alternating in one command):
2.466-2.471 ms/token with the Triton GEMV, 2.459-2.460 with this kernel for qkv and o. What
bounds it is the work after the wait: with the products' arithmetic left out the step took
2.356 ms (2.373 with the input row still read), so widening and multiplying cost ~0.09 ms a
step; reading the scales after the multiply, as a first version did, made the step 2.512.

Rows of a block are padded by 64 bytes in shared memory, so that the two rows a quarter-warp
reads fall in different banks. Compiled with NVRTC (layers/cuda_rtc.py) for the input width
`K`, once a process. Hopper and newer only (bulk copies, PDL).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading

import torch

from aserve.engine.gpu import gpu_capability
from aserve.layers.cuda_rtc import Kernel, compile_cubin, load_kernel

WARPS = 8
ROW_PAD = 64
MAX_BLOCKS = 16
"""Warps of a block, bytes after each row in shared memory, 16-row blocks a block holds (at
most one row a thread)."""

_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
struct __align__(16) Words { u32 x, y, z, w; };

#define SLICE (K / WARPS)
#define SEGMENTS (SLICE / 64)
#define STRIDE (K + ROW_PAD)

static __device__ __forceinline__ u32 shared_address(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// bf16 bits of an FP8 e4m3 word's bytes 0 and 2 (even) or 1 and 3 (odd), each value times
// 2^-120: sign to the half's top bit, exponent and mantissa under bf16's.
static __device__ __forceinline__ u32 even_bytes(u32 w) {
  return ((w << 8) & 0x80008000u) | ((w << 4) & 0x07F007F0u);
}
static __device__ __forceinline__ u32 odd_bytes(u32 w) {
  return (w & 0x80008000u) | ((w >> 4) & 0x07F007F0u);
}

static __device__ __forceinline__ u32 permute(u32 a, u32 b, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

static __device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                           u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ void wait_barrier(u32 bar, u32 parity) {
  u32 done = 0;
  while (!done) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                 "selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
resident_fp8_gemv(const unsigned char* __restrict__ weight, const float* __restrict__ scales,
                  const Words* __restrict__ x, const unsigned short* __restrict__ bias,
                  unsigned short* __restrict__ out, int n, int blocks_per_cta) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int rows_per_cta = blocks_per_cta * 16;
  u64* bars = reinterpret_cast<u64*>(smem);
  float* partial = reinterpret_cast<float*>(smem + 128);
  unsigned char* rows = smem + 128 + (WARPS * rows_per_cta * 4 + 127) / 128 * 128;
  const int first_row = blockIdx.x * rows_per_cta;
  const int my_rows = n - first_row < rows_per_cta ? n - first_row : rows_per_cta;
  const int my_blocks = my_rows / 16;

  // The weight is the host's alone: its rows are copied in before the wait.
  if (threadIdx.x == 0) {
    for (int b = 0; b < my_blocks; ++b)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_address(bars + b)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    if (threadIdx.x == 0) {
      for (int b = 0; b < my_blocks; ++b) {
        u64 state;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 %0, [%1], %2;"
                     : "=l"(state) : "r"(shared_address(bars + b)), "r"(16 * K) : "memory");
      }
    }
    __syncwarp();
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int r = threadIdx.x; r < my_rows; r += 32) {
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
          "[%0], [%1], %2, [%3], %4;"
          :: "r"(shared_address(rows + r * STRIDE)), "l"(weight + (size_t)(first_row + r) * K),
             "r"(K), "r"(shared_address(bars + r / 16)), "l"(policy) : "memory");
    }
  }

  // A row's scale and bias are the host's too (a block holds at most one row a thread).
  float row_scale = 0.f, row_bias = 0.f;
  if (threadIdx.x < my_rows) {
    row_scale = scales[first_row + threadIdx.x] * 1.329227995784916e36f;  // 2^120
    if (bias != nullptr)
      asm("mov.b32 %0, %1;" : "=f"(row_bias) : "r"((u32)bias[first_row + threadIdx.x] << 16));
  }

  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = lane >> 2, quad = lane & 3;
  // B: the input row in every column. Word j of a lane's 16 weight bytes holds columns
  // c..c+3; `even_bytes` pairs c and c+2 (k 2q, 2q+1), `odd_bytes` c+1 and c+3 (k 2q+8, 2q+9).
  u32 b_even[SEGMENTS][4], b_odd[SEGMENTS][4];
#pragma unroll
  for (int s = 0; s < SEGMENTS; ++s) {
    const int column = warp * SLICE + 64 * s + 16 * quad;
    const Words lo = x[column / 8], hi = x[column / 8 + 1];
    const u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      b_even[s][j] = permute(words[2 * j], words[2 * j + 1], 0x5410);
      b_odd[s][j] = permute(words[2 * j], words[2 * j + 1], 0x7632);
    }
  }
  asm volatile("griddepcontrol.launch_dependents;");

  for (int b = 0; b < my_blocks; ++b) {
    wait_barrier(shared_address(bars + b), 0);
    float d[4][4] = {};
    const unsigned char* top = rows + (b * 16 + group) * STRIDE + warp * SLICE + 16 * quad;
    const unsigned char* bottom = top + 8 * STRIDE;
#pragma unroll
    for (int s = 0; s < SEGMENTS; ++s) {
      const Words p = *reinterpret_cast<const Words*>(top + 64 * s);
      const Words q = *reinterpret_cast<const Words*>(bottom + 64 * s);
      const u32 pw[4] = {p.x, p.y, p.z, p.w}, qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        mma(d[j], even_bytes(pw[j]), even_bytes(qw[j]), odd_bytes(pw[j]), odd_bytes(qw[j]),
            b_even[s][j], b_odd[s][j]);
    }
    if (quad == 0) {  // column 0 of rows `group` and `group + 8`
      partial[warp * rows_per_cta + b * 16 + group] = (d[0][0] + d[1][0]) + (d[2][0] + d[3][0]);
      partial[warp * rows_per_cta + b * 16 + group + 8] = (d[0][2] + d[1][2]) + (d[2][2] + d[3][2]);
    }
  }
  __syncthreads();
  if (threadIdx.x < my_rows) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) sum += partial[w * rows_per_cta + threadIdx.x];
    float y = sum * row_scale + row_bias;
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(y));
    out[first_row + threadIdx.x] = h;
  }
}
"""

_lock = threading.Lock()
_kernels: dict[tuple[int, int, int], Kernel] = {}
_unavailable: str | None = None
logger = logging.getLogger(__name__)


def _shared_bytes(rows: int, k: int) -> int:
    return 128 + math.ceil(WARPS * rows * 4 / 128) * 128 + rows * (k + ROW_PAD)


def _layout(n: int, k: int, device: torch.device) -> tuple[int, int, int] | None:
    """(16-row blocks a block, blocks, shared bytes) for an `n` x `k` weight on `device`, or
    None where the kernel does not apply: Hopper or newer, `k` a multiple of 512 up to 4,096
    (the input row lives in registers), `n` of 16, and the weight fitting the SMs' shared
    memory in one wave."""
    capability = gpu_capability(device)
    if capability is None or capability < (9, 0) or k % (64 * WARPS) or k > 4096 or n % 16:
        return None
    properties = torch.cuda.get_device_properties(device)
    per_cta = math.ceil(n // 16 / properties.multi_processor_count)
    shared = _shared_bytes(per_cta * 16, k)
    if per_cta > MAX_BLOCKS or shared > properties.shared_memory_per_block_optin:
        return None
    return per_cta, math.ceil(n // 16 / per_cta), shared


def prepare(n: int, k: int, device: torch.device) -> bool:
    """Whether an `n` x `k` FP8 weight on `device` takes `resident_fp8_gemv`, compiling and
    loading the kernel for its width now (about a second, once a width), not inside a CUDA
    graph's capture. Without NVRTC (or if it fails) the Triton GEMV serves, said once."""
    global _unavailable
    layout = _layout(n, k, device)
    if _unavailable is not None or layout is None:
        return False
    try:
        _kernel(k, layout[2], device)
    except (OSError, RuntimeError) as error:
        _unavailable = str(error)
        logger.warning("one-row FP8 products stay on the Triton GEMV: %s", error)
        return False
    return True


def _kernel(k: int, shared: int, device: torch.device) -> Kernel:
    key = (device.index or 0, k, shared)
    with _lock:
        if key not in _kernels:
            capability = gpu_capability(device)
            assert capability is not None
            arch = f"sm_{capability[0]}{capability[1]}"
            cubin = compile_cubin(
                _SOURCE, "resident_fp8_gemv", arch, {"K": k, "WARPS": WARPS, "ROW_PAD": ROW_PAD}
            )
            _kernels[key] = load_kernel(cubin, "resident_fp8_gemv", device, shared, pdl=True)
        return _kernels[key]


def resident_fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`x W^T * scales + bias` for one bf16 row `x` `[1, K]` and an FP8 `weight` `[N, K]`
    (contiguous, one float32 scale a row) where `prepare` took its shape; a bf16 `[1, N]`
    result."""
    n, k = weight.shape
    layout = _layout(n, k, x.device)
    assert layout is not None and x.shape == (1, k) and x.dtype == torch.bfloat16
    assert weight.is_contiguous() and scales.numel() == n and scales.dtype == torch.float32
    per_cta, grid, shared = layout
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    if bias is not None and bias.dtype != torch.bfloat16:
        bias = bias.to(torch.bfloat16)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    kernel = _kernel(k, shared, x.device)
    args = [
        ctypes.c_void_p(weight.data_ptr()),
        ctypes.c_void_p(scales.data_ptr()),
        ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(0 if bias is None else bias.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(n),
        ctypes.c_int(per_cta),
    ]
    kernel.launch(grid, WARPS * 32, args, torch.cuda.current_stream(x.device).cuda_stream)
    return out
