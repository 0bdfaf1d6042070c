// Decode attention on CPU: one query token a request against its context, read from the KV
// pool through the page table (aserve/attention/torch_native.py says when it is used).
//
// SDPA took ~60 us a layer for one 128-token context of the embedded model on a 2-core box,
// most of it set-up around a few microseconds of arithmetic, plus a dense copy of every
// context kept beside the pool for it. Here one unit of work is a request's KV head with its
// group of query heads over a piece of the context (up to 128 positions; longer contexts
// are cut into equal pieces, joined after), in blocks of 256 positions with a running softmax:
//   s[t] = scale * dot(q, k[t])     (8 lanes of products, then a fixed tree across them)
//   m = max(m, max of the block's s);  rescale the running sum l and output by e^(m_old - m)
//   l += sum of e^(s[t] - m);  out += sum over t in order of e^(s[t] - m) * v[t]
// and out / l at the end, the group's query heads together so that each row of K and V is
// read and widened once for all of them. The order of operations is fixed per request, so
// its output does not depend on its batch. The pool holds float16 (these models' default,
// as llama.cpp keeps a GGUF model's cache: half the bytes to read and keep) or float32;
// float16 values widen exactly, so the arithmetic is the same.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ASERVE_AVX2 1
#if defined(__AVX512F__)
#define ASERVE_AVX512 1
#endif
#elif defined(__aarch64__)
#include <arm_neon.h>
#define ASERVE_NEON 1
#endif
#if defined(ASERVE_AVX2) || defined(ASERVE_NEON)
#define ASERVE_LANES8 1  // `Floats8` below
#endif

namespace {

using c10::Half;

constexpr int64_t kBlock = 256;  // context positions whose K and V stay in cache between passes

// Eight float32 lanes: one AVX2 register, or two NEON ones. The loops below are written once
// on these; each operation is the same IEEE operation on both (fused multiply-adds, the same
// tree of sums across lanes, the same rounding to integers), so an ARM CPU attends with the
// same bits as an x86 one (scripts/arm-qemu-tests.sh compares them).
#ifdef ASERVE_AVX2
using Floats8 = __m256;
inline Floats8 load8(const float* x) { return _mm256_loadu_ps(x); }
inline Floats8 load8(const Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
inline void store8(float* x, Floats8 v) { _mm256_storeu_ps(x, v); }
inline Floats8 splat8(float x) { return _mm256_set1_ps(x); }
inline Floats8 add8(Floats8 a, Floats8 b) { return _mm256_add_ps(a, b); }
inline Floats8 sub8(Floats8 a, Floats8 b) { return _mm256_sub_ps(a, b); }
inline Floats8 mul8(Floats8 a, Floats8 b) { return _mm256_mul_ps(a, b); }
inline Floats8 max8(Floats8 a, Floats8 b) { return _mm256_max_ps(a, b); }
inline Floats8 fma8(Floats8 a, Floats8 b, Floats8 c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats8 fnma8(Floats8 a, Floats8 b, Floats8 c) { return _mm256_fnmadd_ps(a, b, c); }
inline Floats8 round8(Floats8 x) {  // to the nearest integer, ties to even
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 2^n for integral n in [-126, 127], put into the exponent bits.
inline Floats8 power_of_two8(Floats8 n) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}

inline float sum_lanes(Floats8 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Lane j of the result is the sum of the lanes of v[j].
inline Floats8 sum_lanes_of_eight(const Floats8 (&v)[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

inline void prefetch_line(const char* line) {
  // an asm statement, as in cpu_kernels.cpp: GCC may drop the builtin's prefetches
  asm volatile("prefetcht0 %0" : : "m"(*line));
}
#elif defined(ASERVE_NEON)
struct Floats8 {
  float32x4_t low, high;  // lanes 0-3 and 4-7
};
inline Floats8 load8(const float* x) { return {vld1q_f32(x), vld1q_f32(x + 4)}; }
inline Floats8 load8(const Half* x) {
  const float16x8_t h = vld1q_f16(reinterpret_cast<const float16_t*>(x));
  return {vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)};
}
inline void store8(float* x, Floats8 v) {
  vst1q_f32(x, v.low);
  vst1q_f32(x + 4, v.high);
}
inline Floats8 splat8(float x) { return {vdupq_n_f32(x), vdupq_n_f32(x)}; }
inline Floats8 add8(Floats8 a, Floats8 b) {
  return {vaddq_f32(a.low, b.low), vaddq_f32(a.high, b.high)};
}
inline Floats8 sub8(Floats8 a, Floats8 b) {
  return {vsubq_f32(a.low, b.low), vsubq_f32(a.high, b.high)};
}
inline Floats8 mul8(Floats8 a, Floats8 b) {
  return {vmulq_f32(a.low, b.low), vmulq_f32(a.high, b.high)};
}
inline Floats8 max8(Floats8 a, Floats8 b) {
  return {vmaxq_f32(a.low, b.low), vmaxq_f32(a.high, b.high)};
}
inline Floats8 fma8(Floats8 a, Floats8 b, Floats8 c) {  // a * b + c, one rounding
  return {vfmaq_f32(c.low, a.low, b.low), vfmaq_f32(c.high, a.high, b.high)};
}
inline Floats8 fnma8(Floats8 a, Floats8 b, Floats8 c) {  // c - a * b, one rounding
  return {vfmsq_f32(c.low, a.low, b.low), vfmsq_f32(c.high, a.high, b.high)};
}
inline Floats8 round8(Floats8 x) { return {vrndnq_f32(x.low), vrndnq_f32(x.high)}; }
inline Floats8 power_of_two8(Floats8 n) {
  const int32x4_t bias = vdupq_n_s32(127);
  return {vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.low), bias), 23)),
          vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n.high), bias), 23))};
}

// (lanes 0+4 + lanes 2+6) + (lanes 1+5 + lanes 3+7), the AVX2 version's order
inline float sum_lanes(Floats8 v) {
  const float32x4_t x = vaddq_f32(v.low, v.high);
  const float32x2_t y = vadd_f32(vget_low_f32(x), vget_high_f32(x));
  return vget_lane_f32(y, 0) + vget_lane_f32(y, 1);
}

// Lane j is ((v_j0 + v_j1) + (v_j2 + v_j3)) + ((v_j4 + v_j5) + (v_j6 + v_j7)), as the AVX2
// version's horizontal adds give it.
inline Floats8 sum_lanes_of_eight(const Floats8 (&v)[8]) {
  const auto quads = [&](int first, bool high) {
    const auto half = [&](int i) { return high ? v[first + i].high : v[first + i].low; };
    return vpaddq_f32(vpaddq_f32(half(0), half(1)), vpaddq_f32(half(2), half(3)));
  };
  return {vaddq_f32(quads(0, false), quads(0, true)), vaddq_f32(quads(4, false), quads(4, true))};
}

inline void prefetch_line(const char* line) { asm volatile("prfm pldl1keep, %0" : : "Q"(*line)); }
#endif

#ifdef ASERVE_LANES8
// e^x for x <= 0 to about one float ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor
// series to r^7 / 7! (error below 2^-24 there), times 2^n put into the exponent bits.
inline Floats8 exp_nonpositive(Floats8 x) {
  x = max8(x, splat8(-87.0f));  // below this e^x is no longer a normal float
  const Floats8 n = round8(mul8(x, splat8(1.44269504f)));
  Floats8 r = fnma8(n, splat8(0.693359375f), x);  // ln2 in two parts: n times
  r = fnma8(n, splat8(-2.12194440e-4f), r);       // the first is exact
  Floats8 p = splat8(1.0f / 5040);
  p = fma8(p, r, splat8(1.0f / 720));
  p = fma8(p, r, splat8(1.0f / 120));
  p = fma8(p, r, splat8(1.0f / 24));
  p = fma8(p, r, splat8(1.0f / 6));
  p = fma8(p, r, splat8(0.5f));
  p = fma8(p, r, splat8(1.0f));
  p = fma8(p, r, splat8(1.0f));
  return mul8(p, power_of_two8(n));
}

// A row's K and V (n values each at `offset`) asked for ahead of use: a context's slots are
// scattered over the pool, so the hardware's prefetchers do not follow them, and a decode
// step's weights (tens of MB a layer) have pushed the rows out of cache since the step before.
constexpr int64_t kAhead = 8;  // rows ahead
template <typename T>
inline void ask_for_row(int64_t offset, const T* keys, const T* values, int64_t n) {
  const char* k = reinterpret_cast<const char*>(keys + offset);
  const char* v = reinterpret_cast<const char*>(values + offset);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) {
    prefetch_line(k + b);
    prefetch_line(v + b);
  }
}

// The scores of C query heads (queries n apart) against 8 / C rows at a time, so that eight
// sums are always under way: scores[j * apart + t] = scale * dot(q_j, k[t]) for the rows
// `keys + slots[t] * stride` (n, the head size, a multiple of 8). A row of K is widened once
// for the heads that share it (once a head, it took as long as the products); each sum
// gathers in one `Floats8`, and the eight of them are summed across at once. A short last
// pass repeats its first row, so every score is added up the same way.
template <int C, typename T>
void scores8(const float* q, const T* keys, const T* values, const int32_t* slots, int64_t rows,
             int64_t stride, int64_t n, float scale, float* scores, int64_t apart) {
  constexpr int R = 8 / C;
  const Floats8 scaling = splat8(scale);
  for (int64_t first = 0; first < rows; first += R) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      if (first + r + kAhead < rows) ask_for_row(slots[first + r + kAhead] * stride, keys, values, n);
    const T* k[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) k[r] = keys + slots[first + r < rows ? first + r : first] * stride;
    Floats8 sums[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; ++a) sums[a] = splat8(0.0f);
    for (int64_t d = 0; d < n; d += 8) {
      Floats8 kd[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) kd[r] = load8(k[r] + d);
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) {
        const Floats8 qd = load8(q + j * n + d);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) sums[r * C + j] = fma8(qd, kd[r], sums[r * C + j]);
      }
    }
    float lanes[8];
    store8(lanes, mul8(scaling, sum_lanes_of_eight(sums)));
    const int64_t count = std::min<int64_t>(R, rows - first);
    for (int64_t r = 0; r < count; ++r)
      for (int j = 0; j < C; ++j) scores[j * apart + first + r] = lanes[r * C + j];
  }
}

// out_j += sum over the rows t of p_j[t] * v[t] for C heads j (p_j at p + j * apart, out_j at
// out + j * n; n a multiple of 8), 8 / C groups of eight values of every head held in
// registers across the rows (eight sums under way), a row of V widened once for all heads.
template <int C, typename T>
void add_weighted_rows8(const float* p, const T* values, const int32_t* slots, int64_t rows,
                        int64_t stride, int64_t n, float* out, int64_t apart) {
  constexpr int D = 8 / C;
  for (int64_t first = 0; first < n; first += 8 * D) {
    const int64_t chunks = std::min<int64_t>(D, (n - first) / 8);
    Floats8 sums[8];
#pragma GCC unroll 8
    for (int c = 0; c < D; ++c)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j)
        sums[c * C + j] = c < chunks ? load8(out + j * n + first + 8 * c) : splat8(0.0f);
    for (int64_t t = 0; t < rows; ++t) {
      const T* v = values + slots[t] * stride + first;
#pragma GCC unroll 8
      for (int c = 0; c < D; ++c) {
        if (c >= chunks) break;
        const Floats8 vc = load8(v + 8 * c);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j)
          sums[c * C + j] = fma8(splat8(p[j * apart + t]), vc, sums[c * C + j]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      for (int j = 0; j < C; ++j) store8(out + j * n + first + 8 * c, sums[c * C + j]);
  }
}

#ifdef ASERVE_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const Half* x) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// `add_weighted_rows8` in 16 lanes (n a multiple of 16): each output value is the same chain
// of FMAs over the rows in order whatever the width, so the same bits, with K chunks of 16
// values of the C heads in registers for each row of V read (up to 24 sums under way).
template <int C, int K, typename T>
void add_weighted_rows16(const float* p, const T* values, const int32_t* slots, int64_t rows,
                         int64_t stride, int64_t n, float* out, int64_t apart) {
  for (int64_t first = 0; first < n; first += 16 * K) {
    const int64_t chunks = std::min<int64_t>(K, (n - first) / 16);
    __m512 sums[K][C];
#pragma GCC unroll 8
    for (int c = 0; c < K; ++c)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j)
        sums[c][j] = c < chunks ? _mm512_loadu_ps(out + j * n + first + 16 * c) : _mm512_setzero_ps();
    for (int64_t t = 0; t < rows; ++t) {
      const T* v = values + slots[t] * stride + first;
      __m512 weight[C];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) weight[j] = _mm512_set1_ps(p[j * apart + t]);
#pragma GCC unroll 8
      for (int c = 0; c < K; ++c) {
        if (c >= chunks) break;
        const __m512 vc = load16(v + 16 * c);
#pragma GCC unroll 8
        for (int j = 0; j < C; ++j) sums[c][j] = _mm512_fmadd_ps(weight[j], vc, sums[c][j]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c)
      for (int j = 0; j < C; ++j) _mm512_storeu_ps(out + j * n + first + 16 * c, sums[c][j]);
  }
}

template <typename T>
void group_weighted_rows16(const float* p, int64_t count, const T* values, const int32_t* slots,
                           int64_t rows, int64_t stride, int64_t n, float* out, int64_t apart) {
  switch (count) {
    case 1: return add_weighted_rows16<1, 4>(p, values, slots, rows, stride, n, out, apart);
    case 2: return add_weighted_rows16<2, 4>(p, values, slots, rows, stride, n, out, apart);
    case 3: return add_weighted_rows16<3, 4>(p, values, slots, rows, stride, n, out, apart);
    case 4: return add_weighted_rows16<4, 4>(p, values, slots, rows, stride, n, out, apart);
    case 5: return add_weighted_rows16<5, 4>(p, values, slots, rows, stride, n, out, apart);
    case 6: return add_weighted_rows16<6, 4>(p, values, slots, rows, stride, n, out, apart);
    case 7: return add_weighted_rows16<7, 3>(p, values, slots, rows, stride, n, out, apart);
    default: return add_weighted_rows16<8, 3>(p, values, slots, rows, stride, n, out, apart);
  }
}
#endif

// `scores8` / `add_weighted_rows8` for `count` (1 to 8) heads.
template <typename T>
void group_scores8(const float* q, int64_t count, const T* keys, const T* values,
                   const int32_t* slots, int64_t rows, int64_t stride, int64_t n, float scale,
                   float* scores, int64_t apart) {
  for (int64_t t = 0; t < std::min(kAhead, rows); ++t) ask_for_row(slots[t] * stride, keys, values, n);
  switch (count) {
    case 1: return scores8<1>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 2: return scores8<2>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 3: return scores8<3>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 4: return scores8<4>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 5: return scores8<5>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 6: return scores8<6>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    case 7: return scores8<7>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
    default: return scores8<8>(q, keys, values, slots, rows, stride, n, scale, scores, apart);
  }
}

template <typename T>
void group_weighted_rows8(const float* p, int64_t count, const T* values, const int32_t* slots,
                          int64_t rows, int64_t stride, int64_t n, float* out, int64_t apart) {
  switch (count) {
    case 1: return add_weighted_rows8<1>(p, values, slots, rows, stride, n, out, apart);
    case 2: return add_weighted_rows8<2>(p, values, slots, rows, stride, n, out, apart);
    case 3: return add_weighted_rows8<3>(p, values, slots, rows, stride, n, out, apart);
    case 4: return add_weighted_rows8<4>(p, values, slots, rows, stride, n, out, apart);
    case 5: return add_weighted_rows8<5>(p, values, slots, rows, stride, n, out, apart);
    case 6: return add_weighted_rows8<6>(p, values, slots, rows, stride, n, out, apart);
    case 7: return add_weighted_rows8<7>(p, values, slots, rows, stride, n, out, apart);
    default: return add_weighted_rows8<8>(p, values, slots, rows, stride, n, out, apart);
  }
}
#endif

// The heads [0, count) of a group at once (scores of head j at scores + j * apart, queries and
// outputs n apart); without AVX2 or NEON (or for a head size not a multiple of 8) the same
// steps one head and one value at a time.
template <typename T>
void scores_of(const float* q, int64_t count, const T* keys, const T* values,
               const int32_t* slots, int64_t rows, int64_t stride, int64_t n, float scale,
               float* scores, int64_t apart) {
#ifdef ASERVE_LANES8
  if (n % 8 == 0) {
    for (int64_t j = 0; j < count; j += 8)
      group_scores8(q + j * n, std::min<int64_t>(8, count - j), keys, values, slots, rows,
                    stride, n, scale, scores + j * apart, apart);
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j)
    for (int64_t t = 0; t < rows; ++t) {
      const T* k = keys + slots[t] * stride;
      float sum = 0;
      for (int64_t d = 0; d < n; ++d) sum += q[j * n + d] * static_cast<float>(k[d]);
      scores[j * apart + t] = scale * sum;
    }
}

template <typename T>
void add_weighted_rows(const float* p, int64_t count, const T* values, const int32_t* slots,
                       int64_t rows, int64_t stride, int64_t n, float* out, int64_t apart) {
#ifdef ASERVE_AVX512
  if (n % 16 == 0) {
    for (int64_t j = 0; j < count; j += 8)
      group_weighted_rows16(p + j * apart, std::min<int64_t>(8, count - j), values, slots, rows,
                            stride, n, out + j * n, apart);
    return;
  }
#endif
#ifdef ASERVE_LANES8
  if (n % 8 == 0) {
    for (int64_t j = 0; j < count; j += 8)
      group_weighted_rows8(p + j * apart, std::min<int64_t>(8, count - j), values, slots, rows,
                           stride, n, out + j * n, apart);
    return;
  }
#endif
  for (int64_t j = 0; j < count; ++j)
    for (int64_t t = 0; t < rows; ++t) {
      const T* v = values + slots[t] * stride;
      for (int64_t d = 0; d < n; ++d) out[j * n + d] += p[j * apart + t] * static_cast<float>(v[d]);
    }
}

// e^x for one x <= 0 (or -inf). With eight lanes, the vectors' polynomial: the C library's
// expf gave other last bits on ARM than on x86 (in the joins of a context's pieces), and every
// build with them attends with the same bits.
inline float exp_one(float x) {
#ifdef ASERVE_LANES8
  float lanes[8];
  store8(lanes, exp_nonpositive(splat8(x)));
  return x == -INFINITY ? 0.0f : lanes[0];
#else
  return std::exp(x);
#endif
}

// a * b + c, rounded once where the build has eight lanes (their FMA instructions): left to the
// compiler, such a sum in the joins was fused on ARM and not on x86.
inline float multiply_add(float a, float b, float c) {
#ifdef ASERVE_LANES8
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// The largest of `top` and s[0..n).
float largest(const float* s, int64_t n, float top) {
  int64_t t = 0;
#ifdef ASERVE_LANES8
  Floats8 tops = splat8(top);
  for (; t + 8 <= n; t += 8) tops = max8(tops, load8(s + t));
  float lanes[8];
  store8(lanes, tops);
  for (float lane : lanes) top = std::max(top, lane);
#endif
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

// p[t] = e^(s[t] - top) in place; returns their sum (eight running sums, then a fixed tree).
float exponentiate(float* s, int64_t n, float top) {
  int64_t t = 0;
  float sum = 0;
#ifdef ASERVE_LANES8
  const Floats8 shift = splat8(top);
  Floats8 sums = splat8(0.0f);
  for (; t + 8 <= n; t += 8) {
    const Floats8 p = exp_nonpositive(sub8(load8(s + t), shift));
    store8(s + t, p);
    sums = add8(sums, p);
  }
  sum = sum_lanes(sums);
#endif
  for (; t < n; ++t) {
    s[t] = exp_one(s[t] - top);
    sum += s[t];
  }
  return sum;
}

// A group's running max (`top`), sum of weights (`total`) and unnormalised weighted values
// (`out`) before its first block.
inline void clear_fold(float* out, float* top, float* total, int64_t group, int64_t head_dim) {
  std::fill(top, top + group, -INFINITY);
  std::fill(total, total + group, 0.0f);
  std::fill(out, out + group * head_dim, 0.0f);
}

// One block's scores of the group's heads (head j's at scores + j * apart, `rows` of them)
// folded into each head's running max (`top`), sum of weights (`total`) and unnormalised
// weighted values (`out`): the scores are soft-capped where `softcap` is not 0 (Gemma 2:
// softcap * tanh(score / softcap)), the max rises, the old sums are rescaled, the block's
// scores become weights and their rows of V are added in order.
template <typename T>
void fold_block(float* scores, int64_t apart, const T* values, const int32_t* block,
                int64_t rows, int64_t stride, int64_t group, int64_t head_dim, float softcap,
                float* out, float* top, float* total) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * apart;
    float* o = out + g * head_dim;
    if (softcap != 0.0f)
      for (int64_t t = 0; t < rows; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
    const float block_top = largest(s, rows, top[g]);
    if (block_top > top[g]) {
      const float rescale = exp_one(top[g] - block_top);  // 0 for the first block
      total[g] *= rescale;
      for (int64_t d = 0; d < head_dim; ++d) o[d] *= rescale;
      top[g] = block_top;
    }
    total[g] += exponentiate(s, rows, top[g]);
  }
  add_weighted_rows(scores, group, values, block, rows, stride, head_dim, out, apart);
}

// The query heads [head, head + group) of one request, all reading KV head `kv_head` of the
// pool's layer `kv` ([slots, kv_parts, kv_heads, head_dim]; one part: the values are the keys),
// block by block with a running softmax
// (each head's max, sum and weighted values rescaled when its max rises), so that a block's
// K and V come from memory once for the group.
// Leaves each head's weighted values unnormalised in `out`, its running max in `top` and its
// sum of weights in `total`.
template <typename T>
void attend(const float* q, const T* kv, const int32_t* slots, int64_t length,
            int64_t kv_head, int64_t kv_heads, int64_t kv_parts, int64_t group, int64_t head_dim,
            float scale, float softcap, float* out, float* top, float* total,
            std::vector<float>& scratch) {
  scratch.resize(group * kBlock);
  float* scores = scratch.data();
  const int64_t stride = kv_parts * kv_heads * head_dim;
  const T* keys = kv + kv_head * head_dim;
  const T* values = keys + (kv_parts - 1) * kv_heads * head_dim;
  clear_fold(out, top, total, group, head_dim);
  for (int64_t first = 0; first < length; first += kBlock) {
    const int64_t rows = std::min(kBlock, length - first);
    const int32_t* block = slots + first;
    scores_of(q, group, keys, values, block, rows, stride, head_dim, scale, scores, kBlock);
    fold_block(scores, kBlock, values, block, rows, stride, group, head_dim, softcap, out, top,
               total);
  }
}

// A context is cut into pieces of at most this many positions, of equal length, each its
// own unit of work, so that one long request keeps every core busy (with 512, a context of
// 160 over three KV heads made three units for two cores); where the cuts fall depends on
// the context's length alone.
constexpr int64_t kPiece = 128;

// The first position a query of an n-position context reads: with a sliding window of
// `window` positions (0: none), the last `window` of them, its own included.
inline int64_t window_start(int64_t n, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, n - window) : 0;
}

// The length of each piece of an n-position context (the last may be shorter): one formula for
// decode's lone requests and a prefill's runs, so a token is cut alike either way.
inline int64_t piece_length(int64_t n) {
  const int64_t pieces = (n + kPiece - 1) / kPiece;
  return (n + pieces - 1) / pieces;
}

struct Piece {
  int64_t request, first, length;
};

// A prefill's new tokens are requests of their own lengths to `decode_attention`: up to this
// many consecutive tokens of one request are one unit of work, their scores computed together.
constexpr int64_t kRunTokens = 8;

// One request's pieces for a KV head (`count` parts as `attend` leaves them, `apart` floats
// from one to the next) joined in order into its group's outputs (head g's at out + g *
// head_dim), each rescaled to the largest max. With `sinks` (the group's, or null) each
// head's softmax also sums e^sink, a weight that adds no value (gpt-oss's attention sinks).
void join_pieces(const float* parts, int64_t count, int64_t apart, int64_t group,
                 int64_t head_dim, const float* sinks, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float* o = out + g * head_dim;
    float top = sinks != nullptr ? sinks[g] : -INFINITY, total = 0;
    for (int64_t p = 0; p < count; ++p) top = std::max(top, parts[p * apart + group * head_dim + g]);
    std::fill(o, o + head_dim, 0.0f);
    for (int64_t p = 0; p < count; ++p) {
      const float* part = parts + p * apart;
      const float weight = exp_one(part[group * head_dim + g] - top);
      total = multiply_add(weight, part[group * head_dim + group + g], total);
      for (int64_t d = 0; d < head_dim; ++d)
        o[d] = multiply_add(weight, part[g * head_dim + d], o[d]);
    }
    if (sinks != nullptr) total += exp_one(sinks[g] - top);
    for (int64_t d = 0; d < head_dim; ++d) o[d] /= total;
  }
}

// Entries [first, first + count) of a batch that are consecutive new tokens of one request
// (lengths rising by one) against KV head `kv_head`, into their outputs (`outputs`, [batch,
// heads, head_dim]) as `decode_attention` computes each token alone: the same scores (each a
// fixed sum of its own products, whatever else `scores8` computes beside it), the same folds
// of the same pieces, joined the same way. Only the reading is shared: a row of K is widened
// once for four (token, head) pairs, where one token alone read its whole context again.
template <typename T>
void attend_run(const float* queries, int64_t q_stride, const T* kv, const int32_t* context,
                const int64_t* length, int64_t first, int64_t count, int64_t kv_head,
                int64_t kv_heads, int64_t kv_parts, int64_t group, int64_t head_dim, float scale,
                int64_t window, float softcap, const float* sinks, float* outputs,
                std::vector<float>& scratch) {
  const int64_t pairs = count * group, longest = length[first + count - 1];
  const int64_t stride = kv_parts * kv_heads * head_dim;
  const T* keys = kv + kv_head * head_dim;
  const T* values = keys + (kv_parts - 1) * kv_heads * head_dim;
  // [pairs, head_dim] queries, [pairs, longest] their scores (folded where they lie), then a
  // token's pieces' parts
  const int64_t part_size = group * (head_dim + 2), most_pieces = (longest + kPiece - 1) / kPiece;
  scratch.resize(pairs * (head_dim + longest) + most_pieces * part_size);
  float* packed = scratch.data();
  float* scores = packed + pairs * head_dim;
  float* parts = scores + pairs * longest;
  for (int64_t e = 0; e < count; ++e)
    std::copy_n(queries + (first + e) * q_stride + kv_head * group * head_dim, group * head_dim,
                packed + e * group * head_dim);
  // positions before the first token's window are read by none (lengths rise along a run)
  for (int64_t base = window_start(length[first], window); base < longest; base += kBlock) {
    const int64_t rows = std::min(kBlock, longest - base);
#ifdef ASERVE_LANES8
    if (head_dim % 8 == 0) {  // four pairs a pass: two rows of K for four queries' loads
      for (int64_t j = 0; j < pairs; j += 4)
        group_scores8(packed + j * head_dim, std::min<int64_t>(4, pairs - j), keys, values,
                      context + base, rows, stride, head_dim, scale,
                      scores + j * longest + base, longest);
      continue;
    }
#endif
    scores_of(packed, pairs, keys, values, context + base, rows, stride, head_dim, scale,
              scores + base, longest);
  }
  for (int64_t e = 0; e < count; ++e) {
    const int64_t begin = window_start(length[first + e], window);
    const int64_t n = length[first + e] - begin, each = piece_length(n);
    int64_t pieces = 0;
    for (int64_t offset = 0; offset < n; offset += each, ++pieces) {
      const int64_t start = begin + offset, rows = std::min(each, n - offset);
      float* out = parts + pieces * part_size;
      float* top = out + group * head_dim;
      float* total = top + group;
      clear_fold(out, top, total, group, head_dim);
      fold_block(scores + e * group * longest + start, longest, values, context + start, rows,
                 stride, group, head_dim, softcap, out, top, total);
    }
    const int64_t heads = kv_heads * group;
    join_pieces(parts, pieces, part_size, group, head_dim,
                sinks == nullptr ? nullptr : sinks + kv_head * group,
                outputs + ((first + e) * heads + kv_head * group) * head_dim);
  }
}

// q: [batch, heads, head_dim]; this step's K/V are already in the pool (the CPU kernels'
// norm_rope_store writes them). A pool of one part a slot (latent attention's) reads its
// keys as the values too: the output is then as wide as the keys, of which the caller keeps
// the value columns. Request i attends to the first seq_lens[i] slots of
// page-table row rows[i], or to the last `window` of them where `window` is not 0. `sinks`:
// float32 [heads], each head's sink logit (its softmax's extra term), or none. `softcap`:
// the scaled scores' soft cap (Gemma 2), 0 for none.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& table,
                            const at::Tensor& rows, const at::Tensor& seq_lens, double scale,
                            int64_t window, const std::optional<at::Tensor>& sinks,
                            double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 &&
                  q.stride(1) == q.size(2),
              "q: float32 [batch, heads, head_dim], each request's heads contiguous");
  const bool half = kv.scalar_type() == at::kHalf;
  TORCH_CHECK(kv.dim() == 4 && (kv.size(1) == 2 || kv.size(1) == 1) &&
                  (half || kv.scalar_type() == at::kFloat) && kv.is_contiguous(),
              "kv: the pool's contiguous float32 or float16 layer [slots, parts, kv_heads, "
              "head_dim], one or two parts");
  const int64_t kv_parts = kv.size(1);
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt && table.stride(1) == 1,
              "table: int32 page table with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  rows.is_contiguous() && seq_lens.is_contiguous(),
              "rows and seq_lens: contiguous int64");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = kv.size(2);
  TORCH_CHECK(kv.size(3) == head_dim && heads % kv_heads == 0, "q and kv heads do not match");
  TORCH_CHECK(rows.numel() == batch && seq_lens.numel() == batch, "one row and length a request");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                         sinks->numel() == heads),
              "sinks: contiguous float32, one a head");
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* length = seq_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch; ++i)
    TORCH_CHECK(length[i] >= 1 && length[i] <= table.size(1) && row[i] >= 0 && row[i] < table.size(0),
                "a request's row or length is outside the page table");
  at::Tensor out = at::empty({batch, heads, head_dim}, q.options());
  const float* queries = q.data_ptr<float>();
  float* outputs = out.data_ptr<float>();
  const int32_t* slots = table.data_ptr<int32_t>();
  const int64_t group = heads / kv_heads, width = table.stride(0), q_stride = q.stride(0);
  const float softmax_scale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  // Units of work: each piece of a lone request (decode: one long context keeps every core
  // busy), and runs of a prefill's new tokens (`attend_run`), a run and a KV head a unit.
  std::vector<Piece> pieces;  // of the lone requests
  std::vector<int64_t> first_piece(batch + 1);
  std::vector<std::pair<int64_t, int64_t>> runs;  // (first entry, tokens)
  for (int64_t i = 0; i < batch;) {
    int64_t count = 1;
    while (i + count < batch && count < kRunTokens && row[i + count] == row[i] &&
           length[i + count] == length[i] + count)
      ++count;
    if (count > 1) runs.emplace_back(i, count);
    for (int64_t e = i; e < i + count; ++e) {
      first_piece[e] = static_cast<int64_t>(pieces.size());  // a run's tokens: no pieces here
      if (count > 1) continue;
      const int64_t begin = window_start(length[e], window), n = length[e] - begin;
      const int64_t each = piece_length(n);
      for (int64_t offset = 0; offset < n; offset += each)
        pieces.push_back({e, begin + offset, std::min(each, n - offset)});
    }
    i += count;
  }
  first_piece[batch] = static_cast<int64_t>(pieces.size());
  // Per (piece, KV head): the group's unnormalised outputs, then their maxima and sums.
  const int64_t part_size = group * (head_dim + 2);
  std::vector<float> parts(pieces.size() * kv_heads * part_size);
  const int64_t lone_units = static_cast<int64_t>(pieces.size()) * kv_heads;
  const int64_t run_count = static_cast<int64_t>(runs.size());
  at::parallel_for(0, lone_units + run_count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t unit = begin; unit < end; ++unit) {
      if (unit >= lone_units) {
        // runs alternate from both ends (later tokens read longer contexts), so that the
        // threads' contiguous ranges of units carry about equal work
        const int64_t at = (unit - lone_units) / kv_heads, kv_head = (unit - lone_units) % kv_heads;
        const auto [first, count] = runs[at % 2 == 0 ? at / 2 : run_count - 1 - at / 2];
        const int32_t* context = slots + row[first] * width;
        if (half) {
          attend_run(queries, q_stride, static_cast<const Half*>(kv.data_ptr()), context, length,
                     first, count, kv_head, kv_heads, kv_parts, group, head_dim, softmax_scale,
                     window, cap, sink_logits, outputs, scratch);
        } else {
          attend_run(queries, q_stride, kv.data_ptr<float>(), context, length, first, count,
                     kv_head, kv_heads, kv_parts, group, head_dim, softmax_scale, window, cap,
                     sink_logits, outputs, scratch);
        }
        continue;
      }
      const int64_t index = unit / kv_heads;
      const Piece& piece = pieces[index];
      const int64_t kv_head = unit % kv_heads, head = kv_head * group;
      float* part = parts.data() + (index * kv_heads + kv_head) * part_size;
      float* top = part + group * head_dim;
      const float* query = queries + piece.request * q_stride + head * head_dim;
      const int32_t* context = slots + row[piece.request] * width + piece.first;
      if (half) {
        attend(query, static_cast<const Half*>(kv.data_ptr()), context, piece.length, kv_head,
               kv_heads, kv_parts, group, head_dim, softmax_scale, cap, part, top, top + group,
               scratch);
      } else {
        attend(query, kv.data_ptr<float>(), context, piece.length, kv_head, kv_heads, kv_parts,
               group, head_dim, softmax_scale, cap, part, top, top + group, scratch);
      }
    }
  });
  // A lone request's pieces joined (a run's units joined theirs; little work: on the calling
  // thread up to 64 heads, without waking the others).
  at::parallel_for(0, batch * kv_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t i = unit / kv_heads, kv_head = unit % kv_heads;
      if (first_piece[i] == first_piece[i + 1]) continue;  // a run's token
      join_pieces(parts.data() + (first_piece[i] * kv_heads + kv_head) * part_size,
                  first_piece[i + 1] - first_piece[i], kv_heads * part_size, group, head_dim,
                  sink_logits == nullptr ? nullptr : sink_logits + kv_head * group,
                  outputs + (i * heads + kv_head * group) * head_dim);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(aserve_cpu, m) {
  m.def(
      "decode_attention(Tensor q, Tensor kv, Tensor table, Tensor rows, Tensor seq_lens, "
      "float scale, int window=0, Tensor? sinks=None, float softcap=0.) -> Tensor",
      decode_attention);
}
