// Products of float weights (bfloat16, float16 or float32) with float32 activations on CPU.
// 16-bit weights stay in their checkpoint's two bytes and are widened to float32 in registers
// as they are read (aserve/quant/cpu.py says why); widening is exact, so every product is the
// float32 weight's. float32 weights are read as they are: MKL's products of a few rows read
// them at a third of the memory's speed on AMD CPUs (bench/NOTES.md).
//
// A weight is [panels, cols, 8]: output features in panels of 8 (one AVX2 register of
// float32, two NEON ones), and within a panel, input by input, its 8 features' values side
// by side. Every output y[m, n] is one chain of fused multiply-adds over the inputs in order,
// starting from zero, whatever the tile, thread or number of rows, so a sequence's outputs do
// not depend on what it is batched with (as the quantized kernels' in cpu_kernels.cpp).
//
// cpu_kernels.cpp's ops (`linear`, `gated_linear`, `rows`, `dequantize`) hand a weight whose
// words are floats to the functions here.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define FLOAT_AVX2 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define FLOAT_NEON 1
#endif

namespace aserve_float {
namespace {

constexpr int64_t kLanes = 8;
constexpr int64_t kRowBlock = 64;   // rows of x that stay in cache while a unit's panels pass
constexpr int64_t kPanelBlock = 12;  // panels a unit of parallel work: whole tiles of 3 or 4

enum class Format { kHalf, kBFloat16, kFloat32 };

// How a format's values are stored: 16-bit ones as their bits, float32 as it is.
template <Format F>
using Element = std::conditional_t<F == Format::kFloat32, float, uint16_t>;

struct Operands {
  const void* w;   // [panels, cols, 8] of a format's elements
  const float* x;  // [rows, cols]
  float* y;        // [rows, panels * 8]
  int64_t rows, cols, panels;

  template <Format F>
  const Element<F>* panel(int64_t p) const {
    return static_cast<const Element<F>*>(w) + p * cols * kLanes;
  }
  const float* row(int64_t m) const { return x + m * cols; }
  float* out(int64_t m, int64_t p) const { return y + (m * panels + p) * kLanes; }
};

template <Format F>
inline float widen(Element<F> value) {
  if constexpr (F == Format::kFloat32) {
    return value;
  } else if constexpr (F == Format::kBFloat16) {
    const uint32_t wide = static_cast<uint32_t>(value) << 16;
    float widened;
    std::memcpy(&widened, &wide, sizeof widened);
    return widened;
  } else {
    return static_cast<float>(c10::Half(value, c10::Half::from_bits()));
  }
}

// Where a tile's panels and rows start, found once before its loop over the inputs.
template <Format F, int R, int P>
struct TileStarts {
  const Element<F>* panel[P];
  const float* row[R];

  TileStarts(const Operands& a, int64_t m, int64_t p) {
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) panel[q] = a.panel<F>(p + q);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) row[r] = a.row(m + r);
  }
};

#if defined(FLOAT_AVX2)
template <Format F>
inline __m256 widen8(const Element<F>* p) {
  if constexpr (F == Format::kFloat32) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (F == Format::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    } else {
      return _mm256_cvtph_ps(bits);
    }
  }
}

// Rows [m, m + R) against panels [p, p + P): R x P registers of sums, each one output's
// chain of FMAs over the inputs in order.
template <Format F, int R, int P>
void tile(const Operands& a, int64_t m, int64_t p) {
  __m256 sums[R][P];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) sums[r][q] = _mm256_setzero_ps();
  const TileStarts<F, R, P> at(a, m, p);
  for (int64_t k = 0; k < a.cols; ++k) {
    __m256 w[P];
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) w[q] = widen8<F>(at.panel[q] + k * kLanes);
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(at.row[r] + k);
      #pragma GCC unroll 8
      for (int q = 0; q < P; ++q) sums[r][q] = _mm256_fmadd_ps(w[q], x, sums[r][q]);
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q)
      _mm256_storeu_ps(a.out(m + r, p + q), sums[r][q]);
}
#elif defined(FLOAT_NEON)
template <Format F>
inline float32x4_t widen4(const Element<F>* p) {
  if constexpr (F == Format::kFloat32) {
    return vld1q_f32(p);
  } else {
    const uint16x4_t bits = vld1_u16(p);
    if constexpr (F == Format::kBFloat16) {
      return vreinterpretq_f32_u32(vshll_n_u16(bits, 16));
    } else {
      return vcvt_f32_f16(vreinterpret_f16_u16(bits));
    }
  }
}

template <Format F, int R, int P>
void tile(const Operands& a, int64_t m, int64_t p) {
  float32x4_t sums[R][P][2];
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) sums[r][q][0] = sums[r][q][1] = vdupq_n_f32(0.0f);
  const TileStarts<F, R, P> at(a, m, p);
  for (int64_t k = 0; k < a.cols; ++k) {
    float32x4_t w[P][2];
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      w[q][0] = widen4<F>(at.panel[q] + k * kLanes);
      w[q][1] = widen4<F>(at.panel[q] + k * kLanes + 4);
    }
    #pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float32x4_t x = vdupq_n_f32(at.row[r][k]);
      #pragma GCC unroll 8
      for (int q = 0; q < P; ++q) {
        sums[r][q][0] = vfmaq_f32(sums[r][q][0], w[q][0], x);
        sums[r][q][1] = vfmaq_f32(sums[r][q][1], w[q][1], x);
      }
    }
  }
  #pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 8
    for (int q = 0; q < P; ++q) {
      float* out = a.out(m + r, p + q);
      vst1q_f32(out, sums[r][q][0]);
      vst1q_f32(out + 4, sums[r][q][1]);
    }
}
#else
template <Format F, int R, int P>
void tile(const Operands& a, int64_t m, int64_t p) {
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) {
      const Element<F>* panel = a.panel<F>(p + q);
      const float* row = a.row(m + r);
      float* out = a.out(m + r, p + q);
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        float sum = 0.0f;
        for (int64_t k = 0; k < a.cols; ++k)
          sum = std::fma(widen<F>(panel[k * kLanes + lane]), row[k], sum);
        out[lane] = sum;
      }
    }
}
#endif

// Panels [first, last) of rows [m, m + R): tiles of as many panels as keep enough chains of
// FMAs under way (1 and 2 rows: 4 panels; 3 and 4 rows: 3).
template <Format F, int R>
void rows_against(const Operands& a, int64_t m, int64_t first, int64_t last) {
  constexpr int P = R <= 2 ? 4 : 3;
  int64_t p = first;
  for (; p + P <= last; p += P) tile<F, R, P>(a, m, p);
  for (; p < last; ++p) tile<F, R, 1>(a, m, p);
}

template <Format F>
void unit(const Operands& a, int64_t first_row, int64_t last_row, int64_t first, int64_t last) {
  int64_t m = first_row;
  for (; m + 4 <= last_row; m += 4) rows_against<F, 4>(a, m, first, last);
  switch (last_row - m) {
    case 3: rows_against<F, 3>(a, m, first, last); break;
    case 2: rows_against<F, 2>(a, m, first, last); break;
    case 1: rows_against<F, 1>(a, m, first, last); break;
    default: break;
  }
}

// `body(std::integral_constant<Format, F>{})` for the format of `words`: one branch a call,
// not one a value.
template <typename Body>
void with_format(const at::Tensor& words, Body&& body) {
  switch (words.scalar_type()) {
    case at::kBFloat16: body(std::integral_constant<Format, Format::kBFloat16>{}); break;
    case at::kHalf: body(std::integral_constant<Format, Format::kHalf>{}); break;
    default: body(std::integral_constant<Format, Format::kFloat32>{}); break;
  }
}

const void* words_of(const at::Tensor& words) {
  TORCH_CHECK(words.dim() == 3 && words.size(2) == kLanes && words.is_contiguous(),
              "float weights: contiguous [panels, cols, 8]");
  return words.data_ptr();
}

}  // namespace

bool holds(const at::Tensor& words) {
  const at::ScalarType type = words.scalar_type();
  return type == at::kHalf || type == at::kBFloat16 || type == at::kFloat;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& words) {
  const void* w = words_of(words);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) == words.size(1), "x has ", x.size(1), " columns, the weight ",
              words.size(1));
  const int64_t rows = x.size(0), panels = words.size(0);
  at::Tensor y = at::empty({rows, panels * kLanes}, x.options());
  const Operands a{w, x.data_ptr<float>(), y.data_ptr<float>(), rows, x.size(1), panels};
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t panel_blocks = (panels + kPanelBlock - 1) / kPanelBlock;
  with_format(words, [&](auto format) {
    constexpr Format F = decltype(format)::value;
    // units row-block-major: a thread's units mostly share one block of x
    at::parallel_for(0, row_blocks * panel_blocks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t first_row = u / panel_blocks * kRowBlock;
        const int64_t first = u % panel_blocks * kPanelBlock;
        unit<F>(a, first_row, std::min(rows, first_row + kRowBlock), first,
                std::min(panels, first + kPanelBlock));
      }
    });
  });
  return y;
}

// Rows `ids` of the weight as float32 (embedding lookups).
at::Tensor rows(const at::Tensor& words, const at::Tensor& ids) {
  const void* w = words_of(words);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 vector");
  const at::Tensor ids_here = ids.contiguous();
  const int64_t* idp = ids_here.data_ptr<int64_t>();
  const int64_t count = ids.size(0), panels = words.size(0), cols = words.size(1);
  at::Tensor out = at::empty({count, cols}, words.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  with_format(words, [&](auto format) {
    constexpr Format F = decltype(format)::value;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t n = idp[i];
      TORCH_CHECK(n >= 0 && n < panels * kLanes, "row ", n, " is outside the weight");
      const Element<F>* panel = static_cast<const Element<F>*>(w) +
                                n / kLanes * cols * kLanes + n % kLanes;
      for (int64_t k = 0; k < cols; ++k) op[i * cols + k] = widen<F>(panel[k * kLanes]);
    }
  });
  return out;
}

// Panels [first, first + out.size(1) / 8) widened into `out` as a [cols, 8 * panels] float32
// matrix (input-major), for BLAS to multiply many rows by.
void dequantize(const at::Tensor& words, int64_t first, at::Tensor out) {
  const void* w = words_of(words);
  const int64_t cols = words.size(1);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == cols && out.size(1) % kLanes == 0,
              "out: contiguous float32 [cols, 8 * panels]");
  const int64_t width = out.size(1), count = width / kLanes;
  TORCH_CHECK(0 <= first && first + count <= words.size(0), "panels out of range");
  float* op = out.data_ptr<float>();
  with_format(words, [&](auto format) {
    constexpr Format F = decltype(format)::value;
    const Element<F>* all = static_cast<const Element<F>*>(w);
    at::parallel_for(0, cols, 256, [&](int64_t begin, int64_t end) {
      for (int64_t k = begin; k < end; ++k)
        for (int64_t p = 0; p < count; ++p) {
          const Element<F>* from = all + ((first + p) * cols + k) * kLanes;
          float* to = op + k * width + p * kLanes;
          for (int64_t lane = 0; lane < kLanes; ++lane) to[lane] = widen<F>(from[lane]);
        }
    });
  });
}

}  // namespace aserve_float
