// Products of group-quantized weights with float32 activations, on CPU (aserve/quant/native.py
// builds this file and says why it exists).
//
// A weight keeps integer codes with a float32 scale and offset per group of 16 or 32 inputs,
// w = code * scale + offset. Output features come in panels of 8, one per AVX2 lane; within a
// panel, group by group, every 32-bit word holds one feature's codes for consecutive inputs:
//   4-bit codes (0..15): eight inputs a word, input i of the word in bits 4i..4i+3;
//   8-bit codes (-128..127): four inputs a word, input i in bits 8i..8i+7.
// Scales and offsets are stored [panel, group, 8].
//
// y[m, n] = sum over k, in order, of w[n, k] * x[m, k], one fused multiply-add per input and
// the weight de-quantized in a register on the way. Every output takes exactly that sequence of
// operations whatever the number of rows, the tile it falls in or the thread, so a sequence's
// logits do not depend on what it is batched with, nor on how much of its prompt was cached.
// Activations stay float32: rounding them to int8 (llama.cpp's way) turned attention's last-bit
// differences into visible ones. Tiles hold R rows by P panels (R * P = 8 running sums): many
// rows share each de-quantized weight vector, and few rows still have 8 independent sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ASERVE_AVX2 1
#endif

namespace {

constexpr int64_t kLanes = 8;       // output features per panel
constexpr int64_t kRowBlock = 64;   // rows of x that stay in cache while every panel passes
constexpr int64_t kPanelBlock = 8;  // panels per unit of parallel work
constexpr int64_t kManyRows = 16;   // from this many rows the weights are expanded to a buffer

struct Weight {
  const uint32_t* words;  // [panels, groups, words_per_group, 8]
  const float* scales;    // [panels, groups, 8]
  const float* offsets;   // [panels, groups, 8]
  int64_t panels, groups, group, cols;
  bool four_bit;

  int64_t inputs_per_word() const { return four_bit ? 8 : 4; }
  int64_t words_per_group() const { return group / inputs_per_word(); }
  int64_t panel_words() const { return groups * words_per_group() * kLanes; }
};

// The code of input i (of its word) in each lane.
#ifdef ASERVE_AVX2
template <bool FourBit>
inline __m256 code_of(__m256i words, int i) {
  if (FourBit) {
    const __m256i nibble = _mm256_and_si256(_mm256_srli_epi32(words, 4 * i), _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(nibble);
  }
  // Shift the byte to the top, then back down with its sign.
  const __m256i top = _mm256_sllv_epi32(words, _mm256_set1_epi32(24 - 8 * i));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 24));
}

template <int R, int P, bool FourBit>
void tile(const Weight& w, const float* x, int64_t first_row, int64_t first_panel, float* y,
          int64_t out) {
  __m256 acc[R][P];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  constexpr int per_word = FourBit ? 8 : 4;
  const int64_t words = w.words_per_group();
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 scale[P], offset[P];
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) {
      const int64_t at = ((first_panel + p) * w.groups + g) * kLanes;
      scale[p] = _mm256_loadu_ps(w.scales + at);
      offset[p] = _mm256_loadu_ps(w.offsets + at);
    }
    for (int64_t v = 0; v < words; ++v) {
      __m256i word[P];
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) {
        const uint32_t* src =
            w.words + (first_panel + p) * w.panel_words() + (g * words + v) * kLanes;
        word[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
      }
      const int64_t k0 = g * w.group + v * per_word;
      #pragma GCC unroll 16
      for (int i = 0; i < per_word; ++i) {
        #pragma GCC unroll 16
        for (int p = 0; p < P; ++p) {
          const __m256 weight = _mm256_fmadd_ps(code_of<FourBit>(word[p], i), scale[p], offset[p]);
          #pragma GCC unroll 16
          for (int r = 0; r < R; ++r) {
            const __m256 xk = _mm256_broadcast_ss(x + (first_row + r) * w.cols + k0 + i);
            acc[r][p] = _mm256_fmadd_ps(weight, xk, acc[r][p]);
          }
        }
      }
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
      _mm256_storeu_ps(y + (first_row + r) * out + (first_panel + p) * kLanes, acc[r][p]);
}

// Panels [first, first + P) as float32 in `buffer`, [panel][input][lane]: the weights that many
// rows share are expanded once instead of once per tile of rows.
template <int P, bool FourBit>
void expand_panels(const Weight& w, int64_t first, float* buffer) {
  constexpr int per_word = FourBit ? 8 : 4;
  const int64_t words = w.words_per_group();
  #pragma GCC unroll 16
  for (int p = 0; p < P; ++p) {
    float* out = buffer + p * w.cols * kLanes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const int64_t at = ((first + p) * w.groups + g) * kLanes;
      const __m256 scale = _mm256_loadu_ps(w.scales + at), offset = _mm256_loadu_ps(w.offsets + at);
      for (int64_t v = 0; v < words; ++v) {
        const uint32_t* src = w.words + (first + p) * w.panel_words() + (g * words + v) * kLanes;
        const __m256i word = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
        const int64_t k0 = g * w.group + v * per_word;
        #pragma GCC unroll 16
        for (int i = 0; i < per_word; ++i) {
          _mm256_storeu_ps(out + (k0 + i) * kLanes,
                           _mm256_fmadd_ps(code_of<FourBit>(word, i), scale, offset));
        }
      }
    }
  }
}

// The same sums as `tile`, reading the weights from `expand_panels`' buffer.
template <int R, int P>
void tile_from_buffer(const float* buffer, const float* x, int64_t cols, int64_t first_row,
                      int64_t first_panel, float* y, int64_t out) {
  __m256 acc[R][P];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  const float* rows[R];
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r) rows[r] = x + (first_row + r) * cols;
  for (int64_t k = 0; k < cols; ++k) {
    __m256 weight[P];
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p) weight[p] = _mm256_loadu_ps(buffer + (p * cols + k) * kLanes);
    #pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(rows[r] + k);
      #pragma GCC unroll 16
      for (int p = 0; p < P; ++p) acc[r][p] = _mm256_fmadd_ps(weight[p], xk, acc[r][p]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    #pragma GCC unroll 16
    for (int p = 0; p < P; ++p)
      _mm256_storeu_ps(y + (first_row + r) * out + (first_panel + p) * kLanes, acc[r][p]);
}

template <int P>
void rows_from_buffer(const float* buffer, const float* x, int64_t cols, int64_t first,
                      int64_t last, int64_t first_panel, float* y, int64_t out) {
  int64_t row = first;
  for (; row + 6 <= last; row += 6) tile_from_buffer<6, P>(buffer, x, cols, row, first_panel, y, out);
  switch (last - row) {
    case 5: tile_from_buffer<5, P>(buffer, x, cols, row, first_panel, y, out); break;
    case 4: tile_from_buffer<4, P>(buffer, x, cols, row, first_panel, y, out); break;
    case 3: tile_from_buffer<3, P>(buffer, x, cols, row, first_panel, y, out); break;
    case 2: tile_from_buffer<2, P>(buffer, x, cols, row, first_panel, y, out); break;
    case 1: tile_from_buffer<1, P>(buffer, x, cols, row, first_panel, y, out); break;
    default: break;
  }
}

// Many rows: two panels at a time expanded into `buffer` (2 * cols * 8 floats), then every
// row against them.
template <bool FourBit>
void many_rows_against_panels(const Weight& w, const float* x, int64_t first, int64_t last,
                              int64_t first_panel, int64_t last_panel, float* y, int64_t out,
                              float* buffer) {
  int64_t p = first_panel;
  for (; p + 2 <= last_panel; p += 2) {
    expand_panels<2, FourBit>(w, p, buffer);
    rows_from_buffer<2>(buffer, x, w.cols, first, last, p, y, out);
  }
  if (p < last_panel) {
    expand_panels<1, FourBit>(w, p, buffer);
    rows_from_buffer<1>(buffer, x, w.cols, first, last, p, y, out);
  }
}
#else
template <bool FourBit>
inline float code_of(uint32_t word, int i) {
  if (FourBit) return static_cast<float>((word >> (4 * i)) & 15);
  return static_cast<float>(static_cast<int8_t>((word >> (8 * i)) & 255));
}

template <int R, int P, bool FourBit>
void tile(const Weight& w, const float* x, int64_t first_row, int64_t first_panel, float* y,
          int64_t out) {
  constexpr int per_word = FourBit ? 8 : 4;
  const int64_t words = w.words_per_group();
  for (int64_t p = first_panel; p < first_panel + P; ++p) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      float acc[R] = {};
      for (int64_t g = 0; g < w.groups; ++g) {
        const float scale = w.scales[(p * w.groups + g) * kLanes + lane];
        const float offset = w.offsets[(p * w.groups + g) * kLanes + lane];
        for (int64_t v = 0; v < words; ++v) {
          const uint32_t word = w.words[p * w.panel_words() + (g * words + v) * kLanes + lane];
          const int64_t k0 = g * w.group + v * per_word;
          #pragma GCC unroll 16
          for (int i = 0; i < per_word; ++i) {
            const float weight = std::fma(code_of<FourBit>(word, i), scale, offset);
            #pragma GCC unroll 16
            for (int r = 0; r < R; ++r) {
              acc[r] = std::fma(weight, x[(first_row + r) * w.cols + k0 + i], acc[r]);
            }
          }
        }
      }
      #pragma GCC unroll 16
      for (int r = 0; r < R; ++r) y[(first_row + r) * out + p * kLanes + lane] = acc[r];
    }
  }
}
#endif

// Rows [first, last) against panels [first_panel, last_panel): the widest tiles that fit.
template <int R, int P, bool FourBit>
void panels_at(const Weight& w, const float* x, int64_t row, int64_t first_panel,
               int64_t last_panel, float* y, int64_t out) {
  int64_t p = first_panel;
  for (; p + P <= last_panel; p += P) tile<R, P, FourBit>(w, x, row, p, y, out);
  for (; p < last_panel; ++p) tile<R, 1, FourBit>(w, x, row, p, y, out);
}

template <bool FourBit>
void rows_against_panels(const Weight& w, const float* x, int64_t first, int64_t last,
                         int64_t first_panel, int64_t last_panel, float* y, int64_t out) {
  int64_t row = first;
  for (; row + 8 <= last; row += 8) panels_at<8, 1, FourBit>(w, x, row, first_panel, last_panel, y, out);
  if (row + 4 <= last) {
    panels_at<4, 2, FourBit>(w, x, row, first_panel, last_panel, y, out);
    row += 4;
  }
  if (row + 2 <= last) {
    panels_at<2, 4, FourBit>(w, x, row, first_panel, last_panel, y, out);
    row += 2;
  }
  if (row < last) panels_at<1, 8, FourBit>(w, x, row, first_panel, last_panel, y, out);
}

Weight weight_of(const at::Tensor& words, const at::Tensor& scales, const at::Tensor& offsets,
                 int64_t group, bool four_bit) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.is_contiguous(), "words: int32");
  TORCH_CHECK(scales.dim() == 3 && scales.size(2) == kLanes && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "scales: float32 [panels, groups, 8]");
  TORCH_CHECK(offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat &&
                  offsets.is_contiguous(),
              "offsets: as scales");
  TORCH_CHECK(group == 16 || group == 32, "groups are 16 or 32 inputs, got ", group);
  TORCH_CHECK(!four_bit || group == 32, "4-bit codes come in groups of 32");
  const int64_t panels = scales.size(0), groups = scales.size(1);
  Weight w{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
           scales.data_ptr<float>(),
           offsets.data_ptr<float>(),
           panels,
           groups,
           group,
           groups * group,
           four_bit};
  TORCH_CHECK(words.numel() == panels * w.panel_words(), "words do not match the scales");
  return w;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales,
                  const at::Tensor& offsets, int64_t group, bool four_bit) {
  const Weight w = weight_of(words, scales, offsets, group, four_bit);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) == w.cols, "x has ", x.size(1), " columns, the weight ", w.cols);
  const int64_t rows = x.size(0), out = w.panels * kLanes;
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t panel_blocks = (w.panels + kPanelBlock - 1) / kPanelBlock;
  // Work units in row-block-major order: a thread's units mostly share one block of x.
  at::parallel_for(0, row_blocks * panel_blocks, 1, [&](int64_t begin, int64_t end) {
#ifdef ASERVE_AVX2
    std::vector<float> buffer;
#endif
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t rb = unit / panel_blocks, pb = unit % panel_blocks;
      const int64_t first = rb * kRowBlock, last = std::min(rows, first + kRowBlock);
      const int64_t first_panel = pb * kPanelBlock;
      const int64_t last_panel = std::min(w.panels, first_panel + kPanelBlock);
#ifdef ASERVE_AVX2
      if (last - first >= kManyRows) {
        buffer.resize(2 * w.cols * kLanes);
        if (w.four_bit) {
          many_rows_against_panels<true>(w, xp, first, last, first_panel, last_panel, yp, out,
                                         buffer.data());
        } else {
          many_rows_against_panels<false>(w, xp, first, last, first_panel, last_panel, yp, out,
                                          buffer.data());
        }
        continue;
      }
#endif
      if (w.four_bit) {
        rows_against_panels<true>(w, xp, first, last, first_panel, last_panel, yp, out);
      } else {
        rows_against_panels<false>(w, xp, first, last, first_panel, last_panel, yp, out);
      }
    }
  });
  return y;
}

// Rows `ids` of the weight de-quantized (embedding lookups), w = code * scale + offset.
at::Tensor rows(const at::Tensor& words, const at::Tensor& scales, const at::Tensor& offsets,
                int64_t group, bool four_bit, const at::Tensor& ids) {
  const Weight w = weight_of(words, scales, offsets, group, four_bit);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 vector");
  const at::Tensor ids_here = ids.contiguous();
  const int64_t* idp = ids_here.data_ptr<int64_t>();
  const int64_t count = ids.size(0);
  at::Tensor out = at::empty({count, w.cols}, scales.options());
  float* op = out.data_ptr<float>();
  const int64_t per_word = w.inputs_per_word(), words_in_group = w.words_per_group();
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = idp[i];
    TORCH_CHECK(n >= 0 && n < w.panels * kLanes, "row ", n, " is outside the weight");
    const int64_t panel = n / kLanes, lane = n % kLanes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float scale = w.scales[(panel * w.groups + g) * kLanes + lane];
      const float offset = w.offsets[(panel * w.groups + g) * kLanes + lane];
      for (int64_t v = 0; v < words_in_group; ++v) {
        const uint32_t word =
            w.words[panel * w.panel_words() + (g * words_in_group + v) * kLanes + lane];
        for (int64_t j = 0; j < per_word; ++j) {
          const uint32_t code = four_bit ? (word >> (4 * j)) & 15 : (word >> (8 * j)) & 255;
          const float value = four_bit ? static_cast<float>(code)
                                       : static_cast<float>(static_cast<int8_t>(code));
          op[i * w.cols + g * w.group + v * per_word + j] = std::fma(value, scale, offset);
        }
      }
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(aserve_cpu, m) {
  m.def(
      "linear(Tensor x, Tensor words, Tensor scales, Tensor offsets, int group, bool four_bit) "
      "-> Tensor",
      linear);
  m.def(
      "rows(Tensor words, Tensor scales, Tensor offsets, int group, bool four_bit, Tensor ids) "
      "-> Tensor",
      rows);
}
