// Products of group-quantized weights with float32 activations, or with activations rounded
// to 16-bit integers where the CPU has AVX-512 VNNI or AVX2, or is an ARM one with the
// dot-product instructions (`IntActivations` below), on CPU (aserve/quant/native.py builds this
// file and says why it exists).
//
// A weight keeps integer codes with a float32 scale and offset per group of 16 or 32 inputs,
// w = code * scale + offset. Output features come in panels of 8, one per AVX2 lane; within a
// panel, group by group, every 32-bit word holds one feature's codes for consecutive inputs:
//   4-bit codes (0..15): eight inputs a word, input i of the word in bits 4i..4i+3;
//   5- and 6-bit codes (`split`): the low four bits as 4-bit codes, and after a group's code
//     words its high words, two bits an input, 16 inputs a word (input t in bits 2t, 2t+1);
//   8-bit codes (-128..127): four inputs a word, input i in bits 8i..8i+7;
//   2- and 3-bit codes (`three_bit`, Q2_K and Q3_K): for each pair of groups, their low two
//     bits 16 inputs a word, then their high bits 32 inputs a word, laid out so that they
//     widen to 4-bit codes' words by shifts and masks, a few panels at a time as they are
//     multiplied (`widen_three`);
//   entries of a book (`book`: IQ1, IQ2_XXS and IQ2_XS, whose grid index and signs of a
//     run of 8 inputs fit 16 bits, and IQ2_S's and IQ3_XXS's grid indices and signs in 24):
//     entries [run of the group, lane] of 2 or 3 bytes, each standing for a word of 8
//     nibble codes, looked up a unit's panels at a time as they are multiplied (`widen_book`).
// With levels (IQ4_NL / IQ4_XS: 16 integer levels, denser near zero) a 4-bit code c stands
// for levels[c] instead of c; they are kept as bytes, levels[c] + 128.
// Scales and offsets are stored [panel, group, 8], in float32 or, where every one of them
// survives the round trip, float16 (GGUF's own are float16 in most formats), or as int8 steps
// of a float16 base a block of groups (`ScaleKind`: K-quants); offsets that are all zero
// (symmetric or centred formats) are not stored, and their terms below are left out.
//
// Every output y[m, n] is computed by one fixed sequence of float operations:
//   total = 0
//   for each group g:  part = 0;  for k in g, in order: part = fma(code[n, k], x[m, k], part)
//                      total = fma(scale[n, g], part, total)
//                      total = fma(offset[n, g], xsum[m, g], total)
// with xsum[m, g] the sum of x[m, k] over g, added in order. Whatever the number of rows, the
// tile an output falls in or the thread, it gets exactly these operations, so a sequence's
// logits do not depend on what it is batched with. (On CPUs where BLAS is the faster, from
// native.py's BLAS_ROWS rows the caller de-quantizes slices with `dequantize` and multiplies
// them with BLAS instead.)
// Activations are rounded to 16-bit integers per row and block of 32 inputs, which again depend
// on the row alone (`IntActivations`), on CPUs with VNNI (AVX-512's, or the 256-bit AVX-VNNI of
// Intel's cores since Alder Lake), on other AVX2 CPUs (`add_word`: `vpmaddubsw` for 4-bit and
// split codes, `vpmaddwd` for levels and 8-bit ones) and on ARM CPUs with `sdot`; elsewhere
// (AVX-512 without VNNI, older x86, ARM without dot products) they stay float32.
// Rounding them to int8 (llama.cpp's way) had turned attention's last-bit differences between
// a cached and an uncached prefix into visible ones; the CPU attention now computes a query
// alike in both cases (attention/torch_native.py).
// Few rows (decode) expand codes in registers, with four or more registers of sums under way
// (R rows x P panels, or x Q panel pairs with AVX-512: 1 x 4, 2 x 2, 4 x 2, most integer tiles
// 3 x 2) so that the FMAs' latency is hidden; without AVX-512, from 16 rows two panels of codes
// are expanded once into a buffer and 6-row tiles run over it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/silu.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ASERVE_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ASERVE_AVX512 1
#if defined(__AVX512VNNI__)
#define ASERVE_VNNI 1  // activations as 16-bit integers (`IntActivations`)
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define ASERVE_AMX 1  // many rows through AMX's integer tiles (`amx_rows`)
#endif
#endif
#else
// the same integers in 256-bit registers (`int_tile`): `vpdpbusd` with AVX-VNNI, else
// `vpmaddubsw` (4-bit and split codes) and `vpmaddwd` (levels, 8-bit codes: `kPairs`)
#define ASERVE_INT256 1
#endif
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
#include <arm_neon.h>
#define ASERVE_NEON 1  // `IntActivations` through `sdot`
#endif
#if defined(ASERVE_VNNI) || defined(ASERVE_INT256) || defined(ASERVE_NEON)
#define ASERVE_INT 1
#endif

// Float weights (csrc/cpu_float.cpp): the ops below hand them over whole.
namespace aserve_float {
bool holds(const at::Tensor& words);
at::Tensor linear(const at::Tensor& x, const at::Tensor& words);
at::Tensor rows(const at::Tensor& words, const at::Tensor& ids);
void dequantize(const at::Tensor& words, int64_t first, at::Tensor out);
}  // namespace aserve_float

namespace {

// The tiles' helpers marked so are inlined by force: as calls, the tiles' sums went through
// memory (AVX-512, 128-row products 6-9% slower), and GCC left the scales' and prefetches'
// helpers out of line in the 256-bit integer tiles (a fifth of a one-row product's time).
#define ASERVE_INLINE __attribute__((always_inline)) inline

constexpr int64_t kLanes = 8;       // output features per panel
constexpr int64_t kRowBlock = 64;   // rows of x that stay in cache while every panel passes
constexpr int64_t kPanelBlock = 8;  // panels per unit of parallel work
// Panels whose scales, offsets and bases lie interleaved (`Weight::spot`): a one-row tile of
// eight panels then reads them as one stream beside its eight streams of codes, not 24. With
// each panel's kept apart, a 2-core AMD EPYC streamed a Q4_K weight's bytes in that order at
// 19.6 GB/s (loads alone, 2 threads), against 25.5 interleaved (bench/NOTES.md).
constexpr int64_t kScaleBlock = 8;
constexpr int64_t kWidenPanels = 4;  // 3-bit codes' panels widened to nibbles at a time
constexpr int64_t kWidenInRegistersRows = 4;  // up to this many rows, in the x86 int tiles
#ifdef ASERVE_AVX512
// Never: the two-panel tiles beat the buffer at every row count of a block (gate_up 3072x576,
// us at 16 / 32 / 64 rows: 369 / 696 / 1,414 against 536 / 976 / 1,913; bench/NOTES.md).
constexpr int64_t kManyRows = kRowBlock + 1;
#else
constexpr int64_t kManyRows = 16;  // from this many rows the codes are expanded to a buffer
#endif

// How a weight keeps its scales and offsets: float32, float16 (GGUF's own, where every value
// survives the round trip), or int8 steps of a float16 base a block of groups (K-quants: a
// scale is a float16 times a small integer, the integers per group and the float16 per block
// of 256 inputs, kept as the file has it; steps times base is that same float32 exactly, in a
// byte a group instead of four).
enum class ScaleKind { kFloat, kHalf, kSteps };

// The 8 lanes' words in the compiler's vectors (GCC's and clang's vector extension: one AVX2
// register, two NEON ones); written as a loop over lanes, GCC left the widening scalar.
typedef uint32_t Words8 __attribute__((vector_size(32)));

// A `three_bit` weight's nibble word of each lane, from a pair of groups' low word (`low`,
// shifted by `low_shift`) and high word (`high`, shifted by `high_shift`): `widen_three`
// says which words and shifts make which nibble word.
ASERVE_INLINE Words8 nibble_word(const uint32_t* low, const uint32_t* high, int low_shift,
                                 int high_shift) {
  Words8 l, h;
  std::memcpy(&l, low, sizeof l);
  std::memcpy(&h, high, sizeof h);
  return (l >> low_shift & 0x33333333u) | (h >> high_shift & 0x11111111u) << 2;
}

struct Weight {
  const uint32_t* words;  // [panels, groups, words_per_group, 8]
  const void* scales;     // [panels, groups, 8] of `scale_kind`, in blocks of panels (`spot`)
  const void* offsets;    // as scales, or null where every offset is zero
  ScaleKind scale_kind;
  const c10::Half* bases;  // steps: [panels, blocks, 2, 8], a block's scale base, then offset
                           // base, in blocks of panels as the scales (`spot`)
  int64_t block_shift;    // steps: log2 of the groups a block
  int64_t panels, groups, group, cols;
  int64_t scale_panels;     // panels of the layout that scales, offsets and bases lie in
  int64_t panel_shift = 0;  // where panel 0 lies in it (a slice of panels: `panels_from`)
  bool four_bit;
  bool split;             // 5- or 6-bit codes: a nibble word, then two bits an input apart
  const uint8_t* levels;  // 16 levels + 128 for 4-bit codes that stand for them, else null;
                          // split codes: their low bits' levels, code - center (centred codes;
                          // the vector tiles take only the center, `split_center`)
  bool three_bit = false;  // 2- or 3-bit codes in three bits (`four_bit` too: they multiply as
                           // 4-bit codes once widened, which every use of `words` does first)
  const uint32_t* book = nullptr;  // entries of a book: its words (`four_bit` too, likewise):
                                   // 16-bit entries' patterns, or for 24-bit ones their low
                                   // 16 bits' patterns, then 256 words of nibbles to flip
                                   // by the top 8 (`Runs`)
  int64_t entry_bytes = 0;         // 2 or 3

  bool widens() const { return three_bit || book != nullptr; }

  int64_t inputs_per_word() const { return four_bit || split ? 8 : 4; }
  int64_t code_words() const { return group / inputs_per_word(); }  // a group's, a lane
  int64_t words_per_group() const { return code_words() + (split ? group / 16 : 0); }
  int64_t panel_words() const {
    if (book != nullptr) return groups * group / 8 * entry_bytes * kLanes / 4;  // a run's entry
    return three_bit ? groups / 2 * (3 * group / 16) * kLanes : groups * words_per_group() * kLanes;
  }
  // Where a panel's group g finds its 8 lanes' scales and offsets (`at`, the same place in
  // both) and, for steps, its block's bases (`base`: the scales' 8, then the offsets'). Each
  // block of `kScaleBlock` panels lies group-major, [groups, panels of the block, 8], and its
  // bases [blocks of groups, panels of the block, 2, 8]; the last block holds what panels are
  // left. Worked out once for a panel's scales and offsets: three times as many of these sums
  // a group had made the tiles of 16-64 rows 13-18% slower.
  struct Spot {
    int64_t at;
    const c10::Half* base;  // null unless steps
  };
  ASERVE_INLINE Spot spot(int64_t panel, int64_t g) const {
    const int64_t p = panel + panel_shift, in_block = p & (kScaleBlock - 1), first = p - in_block;
    const int64_t count =
        first + kScaleBlock <= scale_panels ? kScaleBlock : scale_panels - first;
    const c10::Half* base =
        bases == nullptr
            ? nullptr
            : bases + first * base_values() + ((g >> block_shift) * count + in_block) * 2 * kLanes;
    return {(first * groups + g * count + in_block) * kLanes, base};
  }
  // The spot of `panel` + 1 from `panel`'s (`s`): next to it in their block, unless `panel`
  // ends one. (The tiles' pairs start at even panels, so theirs never do: half the sums.)
  ASERVE_INLINE Spot next_spot(const Spot& s, int64_t panel, int64_t g) const {
    if (((panel + panel_shift) & (kScaleBlock - 1)) == kScaleBlock - 1) return spot(panel + 1, g);
    return {s.at + kLanes, s.base == nullptr ? nullptr : s.base + 2 * kLanes};
  }
  int64_t scale_bytes() const {
    return scale_kind == ScaleKind::kFloat ? 4 : scale_kind == ScaleKind::kHalf ? 2 : 1;
  }
  // The layout's panels [first, last) whose blocks hold panels [panel, panel + count).
  std::pair<int64_t, int64_t> scale_blocks(int64_t panel, int64_t count) const {
    const int64_t first = panel + panel_shift, last = first + count - 1;
    return {first - first % kScaleBlock,
            std::min(scale_panels, last - last % kScaleBlock + kScaleBlock)};
  }
  int64_t base_values() const {  // a panel's bases
    return scale_kind == ScaleKind::kSteps ? (groups >> block_shift) * 2 * kLanes : 0;
  }

  float value(const void* values, int which, int64_t panel, int64_t g, int64_t lane) const {
    const Spot s = spot(panel, g);
    const int64_t i = s.at + lane;
    switch (scale_kind) {
      case ScaleKind::kFloat: return static_cast<const float*>(values)[i];
      case ScaleKind::kHalf: return static_cast<float>(static_cast<const c10::Half*>(values)[i]);
      default: break;
    }
    const float step = static_cast<float>(static_cast<const int8_t*>(values)[i]);
    return step * static_cast<float>(s.base[which * kLanes + lane]);
  }
  float scale(int64_t panel, int64_t g, int64_t lane) const { return value(scales, 0, panel, g, lane); }
  float offset(int64_t panel, int64_t g, int64_t lane) const {
    return offsets == nullptr ? 0.0f : value(offsets, 1, panel, g, lane);
  }

#ifdef ASERVE_AVX2
  // The 8 lanes' scales (`which` 0) or offsets (1) at spot `s`, as `value` gives each.
  ASERVE_INLINE __m256 lanes(const void* values, int which, const Spot& s) const {
    const int64_t i = s.at;
    switch (scale_kind) {
      case ScaleKind::kFloat: return _mm256_loadu_ps(static_cast<const float*>(values) + i);
      case ScaleKind::kHalf:
        return _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(values) + i)));
      default: break;
    }
    const __m128i steps = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(values) + i));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(steps)),
                         bases8(s.base + which * kLanes));
  }
  // 8 lanes' bases as floats
  ASERVE_INLINE static __m256 bases8(const c10::Half* at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  }
  // A panel's group's scales and offsets at spot `s` (zeros where there are none).
  ASERVE_INLINE void scales_and_offsets8(const Spot& s, __m256& scale, __m256& offset) const {
    scale = lanes(scales, 0, s);
    offset = offsets == nullptr ? _mm256_setzero_ps() : lanes(offsets, 1, s);
  }
#endif
};

struct Rows {
  const float* x;         // row m at x + m * x_stride, or where picked, x + picked[m] * x_stride
  const int64_t* picked;  // null, or the rows of x to multiply (a MoE expert's tokens)
  int64_t x_stride;
  const float* xsum;  // [rows, groups]
  float* y;           // [rows, out]
  int64_t cols, groups, out;
  // Where the integer tiles take the product (`IntActivations`): each row's activations as
  // 16-bit integers (cols / 2 words a row: in two bytes, or whole for `kPairs`), a float32
  // scale a block of 32 inputs and the integers' sum a run of 16; else null.
  const int32_t* xq;
  const float* xscale;
  const int32_t* xisum;
  // Where AMX's tiles take the product (16 rows or more; not 8-bit codes): `xq` in the tiles'
  // order (`tile_order`); else null.
  const int32_t* xt = nullptr;

  int64_t blocks() const { return (cols + 31) / 32; }

  const float* row(int64_t m) const { return x + (picked ? picked[m] : m) * x_stride; }
};

// How a word's codes become floats.
enum class Kind { kNibbles, kBytes, kLevels, kSplit };

inline Kind kind_of(const Weight& w) {
  if (w.split) return Kind::kSplit;
  return w.levels != nullptr ? Kind::kLevels : w.four_bit ? Kind::kNibbles : Kind::kBytes;
}

// What a split code's low four bits stand for at 0 (minus the level of 0: codes centred on
// zero, e.g. Q6_K's -32).
inline int split_center(const Weight& w) {
  return w.levels == nullptr ? 0 : 128 - static_cast<int>(w.levels[0]);
}

// Code word v of a panel's group (`words` its first word of the group, lane `lane`) and the
// high bits of its inputs, input i of the word at bits 2i, 2i + 1 (split codes).
inline uint32_t high_bits(const Weight& w, const uint32_t* words, int64_t v, int64_t lane) {
  return words[(w.code_words() + v / 2) * kLanes + lane] >> (16 * (v % 2));
}

// A cache line asked for, as an asm statement: GCC 12 at -O3 dropped `__builtin_prefetch`'s
// prefetches from `NextPanels`' loop.
ASERVE_INLINE void prefetch_line(const char* line) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*line));
#elif defined(__aarch64__)
  asm volatile("prfm pldl1keep, %0" : : "Q"(*line));
#else
  __builtin_prefetch(line);
#endif
}

// Whether one-row tiles ask for their next panels ahead (`NextPanels`), set per CPU by
// native.py, which times one-row products both ways: on a Xeon the requests won ~14% of a
// decode step, on an AMD EPYC with AVX-512 they cost a Q4_K_M decode step ~13%, where tiles of
// 16 rows gained 2-5% by them and longer ones neither (bench/NOTES.md). Tiles of more rows
// always ask.
bool one_row_tiles_ask_ahead = true;

bool one_row_prefetch(std::optional<bool> enable) {
  if (enable.has_value()) one_row_tiles_ask_ahead = *enable;
  return one_row_tiles_ask_ahead;
}

// Whether a tile of R rows asks for its next panels ahead, `first` (the first of its row
// block) or not.
template <int R>
inline bool asks_ahead(bool first = true) {
  return first && (R > 1 || one_row_tiles_ask_ahead);
}

// Panels [next, next + count)'s codes, scales, offsets and bases asked for ahead of use, in
// as many slices as the weight has groups: a tile reading its own panels, group by group,
// brings the next tile's bytes in meanwhile. (The hardware's prefetchers alone left the
// products about as slow as reading the bytes and then computing, on a Xeon: bench/NOTES.md.)
// Each stream's slices end at multiples of one step worked out once a tile: computing every
// slice's ends by division had taken 40% of a one-row product's time in the 256-bit builds.
class NextPanels {
 public:
  NextPanels(const Weight& w, int64_t next, int64_t count, bool enabled = true) {
    next = std::min(next, w.panels);
    count = enabled ? std::min(count, w.panels - next) : 0;
    if (count <= 0) return;
    const int64_t groups = w.groups;
    auto add = [&](const void* start, int64_t bytes) {
      const int64_t step = (bytes + groups - 1) / groups;
      streams_[used_++] = {static_cast<const char*>(start), bytes, step, 0};
    };
    add(w.words + next * w.panel_words(), count * w.panel_words() * 4);
    // the blocks of scales, offsets and bases that hold those panels' (`Weight::spot`)
    const auto [first, last] = w.scale_blocks(next, count);
    const int64_t scale_bytes = w.groups * kLanes * w.scale_bytes();
    add(static_cast<const char*>(w.scales) + first * scale_bytes, (last - first) * scale_bytes);
    if (w.offsets != nullptr)
      add(static_cast<const char*>(w.offsets) + first * scale_bytes, (last - first) * scale_bytes);
    if (w.bases != nullptr)
      add(w.bases + first * w.base_values(), (last - first) * w.base_values() * sizeof(c10::Half));
  }

  // Slice g's lines (g = 0, 1, ... in turn).
  ASERVE_INLINE void ask(int64_t g) {
    for (int i = 0; i < used_; ++i) {
      Stream& s = streams_[i];
      const int64_t end = std::min(s.bytes, s.step * (g + 1));
      for (; s.asked < end; s.asked += 64) prefetch_line(s.base + s.asked);
    }
  }

 private:
  struct Stream {
    const char* base;
    int64_t bytes, step, asked;  // `asked`: bytes from base whose lines were asked for
  };
  Stream streams_[4];
  int used_ = 0;
};

#ifdef ASERVE_INT
// Activations as 16-bit integers (`IntActivations`). Each block of 32 inputs of a row gets a
// scale s = max |x| / 32639 and x = s * (256 * hi + lo), hi and lo signed bytes, to within
// s / 2: about 15 bits of the block's largest value, where rounding to int8 (llama.cpp's 7
// bits) had turned attention's last-bit differences between a cached and an uncached prefix
// into changed greedy tokens. `vpdpbusd` multiplies four unsigned code bytes by four signed
// activation bytes and adds the four products to a 32-bit sum in one instruction; two of them
// (hi, lo) give 64 16-bit products where the float tiles make 16 with an FMA after expanding
// each code. Integer sums are exact, so the one fixed order of float operations per output
// stays: per group, part = float(256 * sum_hi + sum_lo - bias * sum(x)) * s, then
// total = fma(scale, part, total) and fma(offset, xsum, total) as the float tiles do, xsum
// the group's sum of the rounded activations (the product is the weight's with exactly
// those). A row's integers depend on that row alone, so its outputs still do not depend on
// its batch. One row: 1.4x the float tiles' speed (Q4_K 46 -> 65 GB/s, Q6_K 40 -> 58 on a
// 2-core Zen 5 VM); 128 rows 1.4-1.5x (Q4_K 183 -> 280 GMAC/s; bench/NOTES.md).
//
// A row's words follow the weight's: for 4-bit and split codes, each word of 8 inputs gives
// four words, the hi bytes of inputs 0, 2, 4, 6, their lo bytes, then the odd inputs' (a code
// word's nibbles split by one mask into even and odd inputs); for 8-bit codes each word of 4
// inputs gives its hi bytes, then its lo bytes; where the 256-bit tiles multiply 16-bit codes
// (`kPairs`), the same words hold the integers whole, two a word (`quantize_block`).
constexpr float kIntLimit = 32639.0f;  // 127 * 256 + 127: hi and lo both within a signed byte

// Whether the 256-bit tiles multiply codes of kind K as 16-bit integers, two inputs a 32-bit
// lane by `vpmaddwd`, the activations' 16-bit steps whole (`CodePairs`): levels and 8-bit codes
// where there is no AVX-VNNI. Their bytes go up to 255, past what `vpmaddubsw` adds without
// saturating (`add_word`).
template <Kind K>
constexpr bool kPairs =
#if defined(ASERVE_INT256) && !defined(__AVXVNNI__)
    K == Kind::kLevels || K == Kind::kBytes;
#else
    false;
#endif

// What a code byte stands for above its value: codes are read as unsigned bytes, so 8-bit
// codes (sign flipped) and levels (kept as level + 128) stand 128 above, split codes their
// center above (Q6_K's 32), 4-bit codes none.
template <Kind K>
inline int code_bias(const Weight& w) {
#ifdef ASERVE_NEON
  if (K == Kind::kBytes || K == Kind::kLevels) return 0;  // `sdot` reads them as signed bytes
#endif
  if (kPairs<K>) return 0;  // signed 16-bit codes
  return K == Kind::kNibbles ? 0 : K == Kind::kSplit ? split_center(w) : 128;
}

// What closes row `row`'s integer sums of group g (of `group` inputs): the bias times the
// group's sum of the row's rounded activations, taken off, and their scale in its block.
ASERVE_INLINE std::pair<int32_t, float> group_shift_and_scale(const Rows& a, int64_t row,
                                                              int64_t g, int64_t group, int bias) {
  const int32_t* sums = a.xisum + row * (a.cols / 16) + g * group / 16;
  const int32_t sum = group == 32 ? sums[0] + sums[1] : sums[0];
  return {bias * sum, a.xscale[row * a.blocks() + g * group / 32]};
}
#endif

#ifdef ASERVE_AVX2

// The 16 level bytes in both 128-bit halves of a register (byte shuffles stay in a half),
// loaded once per tile.
inline __m256i levels_of(const Weight& w) {
  if (w.levels == nullptr) return _mm256_setzero_si256();
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)));
}

// A word of each lane ready to be read input by input: for levels, its eight codes looked
// up at once by two byte shuffles, the even inputs' level bytes in `even` and the odd ones'
// in `odd` (input i in byte i / 2); otherwise the word itself.
struct Unpacked {
  __m256i even, odd;
};

// A split code word with its inputs' high bits (`high`, input i at bits 2i, 2i + 1).
template <Kind K>
inline Unpacked unpack(__m256i word, __m256i levels, __m256i high = _mm256_setzero_si256()) {
  if (K == Kind::kSplit) return {word, high};
  if (K != Kind::kLevels) return {word, word};
  const __m256i nibbles = _mm256_set1_epi8(15);
  return {_mm256_shuffle_epi8(levels, _mm256_and_si256(word, nibbles)),
          _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi32(word, 4), nibbles))};
}

// Code word v of a panel's group (`group_words`, its first word) for all 8 lanes, with its
// inputs' high bits for split codes.
template <Kind K>
inline Unpacked unpack_word(const Weight& w, const uint32_t* group_words, int64_t v,
                            __m256i levels) {
  const auto load = [&](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_words + at * kLanes));
  };
  const __m256i high = K == Kind::kSplit
                           ? _mm256_srli_epi32(load(w.code_words() + v / 2), 16 * (v % 2))
                           : _mm256_setzero_si256();
  return unpack<K>(load(v), levels, high);
}

// The code (or level) of input i in each lane, as a float.
template <Kind K>
inline __m256 code_of(const Unpacked& word, int i, float center = 0.0f) {
  // A code c below 2^23 put in the mantissa of 2^23 is the float 2^23 + c; subtracting 2^23
  // leaves c exactly. Cheaper than an int-to-float conversion, which some CPUs run on one
  // port only. 8-bit codes are stored with their sign flipped (c + 128) for this, and levels
  // are kept as bytes of level + 128.
  const __m256i magic = _mm256_set1_epi32(0x4B000000);
  if (K == Kind::kNibbles) {
    const __m256i code =
        _mm256_and_si256(_mm256_srli_epi32(word.even, 4 * i), _mm256_set1_epi32(15));
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(code, magic)),
                         _mm256_set1_ps(8388608.0f));
  }
  if (K == Kind::kSplit) {  // low | high << 4, minus the center
    const __m256i low = _mm256_and_si256(_mm256_srli_epi32(word.even, 4 * i), _mm256_set1_epi32(15));
    const __m256i high =
        _mm256_and_si256(_mm256_srli_epi32(word.odd, 2 * i), _mm256_set1_epi32(3));
    const __m256i code = _mm256_or_si256(low, _mm256_slli_epi32(high, 4));
    return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(code, magic)),
                         _mm256_set1_ps(8388608.0f + center));
  }
  __m256i code;
  if (K == Kind::kLevels) {
    const __m256i bytes = i % 2 ? word.odd : word.even;
    code = _mm256_and_si256(_mm256_srli_epi32(bytes, 8 * (i / 2)), _mm256_set1_epi32(255));
  } else {
    const __m256i flipped = _mm256_xor_si256(word.even, _mm256_set1_epi32(0x80808080));
    code = _mm256_and_si256(_mm256_srli_epi32(flipped, 8 * i), _mm256_set1_epi32(255));
  }
  return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(code, magic)), _mm256_set1_ps(8388736.0f));
}

// One group's part folded into the totals: total = fma(scale, part, total), then the offset.
// (`scale` and `offset` are the panel's of group g, `scales_and_offsets8`, read once for all
// rows of a tile.)
inline __m256 close_group(const Weight& w, const Rows& a, int64_t row, int64_t g, __m256 scale,
                          __m256 offset, __m256 part, __m256 total) {
  total = _mm256_fmadd_ps(scale, part, total);
  if (w.offsets == nullptr) return total;
  return _mm256_fmadd_ps(offset, _mm256_broadcast_ss(a.xsum + row * a.groups + g), total);
}

// Group g's parts of R rows x P panels folded into their totals by `close_group`'s operations,
// each panel's scales and offsets made once for all rows and the offsets' terms left out
// where there are none (as `close_pairs` with AVX-512): closing a row and panel at a time had
// taken more time than the integer tiles' products (perf; 128 rows, AVX-VNNI build, Q4_K 123
// -> 155 GMAC/s, Q6_K 82 -> 104; `close_group` with the values made once a panel 147 and 95).
template <int R, int P>
ASERVE_INLINE void close_panels(const Weight& w, const Rows& a, int64_t first_row,
                                int64_t first_panel, int64_t g, const __m256 (&part)[R][P],
                                __m256 (&total)[R][P]) {
  Weight::Spot s = w.spot(first_panel, g);
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    if (p > 0) s = w.next_spot(s, first_panel + p - 1, g);
    __m256 scale, offset;
    w.scales_and_offsets8(s, scale, offset);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[r][p] = _mm256_fmadd_ps(scale, part[r][p], total[r][p]);
    if (w.offsets == nullptr) continue;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      total[r][p] = _mm256_fmadd_ps(
          offset, _mm256_broadcast_ss(a.xsum + (first_row + r) * a.groups + g), total[r][p]);
  }
}

template <int R, int P>
inline void set_zero(__m256 (&sums)[R][P]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) sums[r][p] = _mm256_setzero_ps();
}

// R rows against P panels, codes expanded in registers.
template <int R, int P, Kind K>
void tile(const Weight& w, const Rows& a, int64_t first_row, int64_t first_panel) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const __m256i levels = levels_of(w);
  const float center = static_cast<float>(split_center(w));
  const int64_t words = w.words_per_group(), code_words = w.code_words();
  const float* x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) x[r] = a.row(first_row + r);
  __m256 total[R][P];
  set_zero(total);
  NextPanels next(w, first_panel + P, P, asks_ahead<R>());
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    __m256 part[R][P];
    set_zero(part);
    for (int64_t v = 0; v < code_words; ++v) {
      const int64_t k0 = g * w.group + v * per_word;
      Unpacked word[P];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p)
        word[p] = unpack_word<K>(
            w, w.words + (first_panel + p) * w.panel_words() + g * words * kLanes, v, levels);
#pragma GCC unroll 8
      for (int i = 0; i < per_word; ++i) {
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) {
          const __m256 code = code_of<K>(word[p], i, center);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m256 xk = _mm256_broadcast_ss(x[r] + k0 + i);
            part[r][p] = _mm256_fmadd_ps(code, xk, part[r][p]);
          }
        }
      }
    }
    close_panels(w, a, first_row, first_panel, g, part, total);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
      _mm256_storeu_ps(a.y + (first_row + r) * a.out + (first_panel + p) * kLanes, total[r][p]);
}

// Panels [first, first + P) as float codes in `buffer`, [panel][input][lane]: the codes that
// many rows share are expanded once instead of once per tile of rows.
template <int P, Kind K>
void expand_panels(const Weight& w, int64_t first, float* buffer) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const __m256i levels = levels_of(w);
  const float center = static_cast<float>(split_center(w));
  const int64_t words = w.words_per_group(), code_words = w.code_words();
  for (int p = 0; p < P; ++p) {
    float* out = buffer + p * w.cols * kLanes;
    for (int64_t g = 0; g < w.groups; ++g) {
      const uint32_t* src = w.words + (first + p) * w.panel_words() + g * words * kLanes;
      for (int64_t v = 0; v < code_words; ++v) {
        const Unpacked bits = unpack_word<K>(w, src, v, levels);
        const int64_t k0 = g * w.group + v * per_word;
#pragma GCC unroll 8
        for (int i = 0; i < per_word; ++i) {
          _mm256_storeu_ps(out + (k0 + i) * kLanes, code_of<K>(bits, i, center));
        }
      }
    }
  }
}

// The same operations as `tile`, codes read from `expand_panels`' buffer; the totals wait in
// y between groups (12 parts fill the registers).
template <int R, int P>
void tile_from_buffer(const Weight& w, const Rows& a, const float* buffer, int64_t first_row,
                      int64_t first_panel) {
  const float* rows[R];
  float* totals[R];
  const float* codes[P];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) codes[p] = buffer + p * a.cols * kLanes;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    rows[r] = a.row(first_row + r);
    totals[r] = a.y + (first_row + r) * a.out + first_panel * kLanes;
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) _mm256_storeu_ps(totals[r] + p * kLanes, _mm256_setzero_ps());
  }
  NextPanels next(w, first_panel + P, P);  // the next panels to expand (again each tile)
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    __m256 part[R][P];
    set_zero(part);
    const int64_t begin = g * w.group, end = begin + w.group;
    for (int64_t k = begin; k < end; ++k) {
      __m256 code[P];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) code[p] = _mm256_loadu_ps(codes[p] + k * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xk = _mm256_broadcast_ss(rows[r] + k);
#pragma GCC unroll 8
        for (int p = 0; p < P; ++p) part[r][p] = _mm256_fmadd_ps(code[p], xk, part[r][p]);
      }
    }
    Weight::Spot s = w.spot(first_panel, g);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      if (p > 0) s = w.next_spot(s, first_panel + p - 1, g);
      __m256 scale, offset;
      w.scales_and_offsets8(s, scale, offset);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* total = totals[r] + p * kLanes;
        _mm256_storeu_ps(total, close_group(w, a, first_row + r, g, scale, offset, part[r][p],
                                            _mm256_loadu_ps(total)));
      }
    }
  }
}

template <int P>
void rows_from_buffer(const Weight& w, const Rows& a, const float* buffer, int64_t first,
                      int64_t last, int64_t panel) {
  int64_t row = first;
  for (; row + 6 <= last; row += 6) tile_from_buffer<6, P>(w, a, buffer, row, panel);
  switch (last - row) {
    case 5: tile_from_buffer<5, P>(w, a, buffer, row, panel); break;
    case 4: tile_from_buffer<4, P>(w, a, buffer, row, panel); break;
    case 3: tile_from_buffer<3, P>(w, a, buffer, row, panel); break;
    case 2: tile_from_buffer<2, P>(w, a, buffer, row, panel); break;
    case 1: tile_from_buffer<1, P>(w, a, buffer, row, panel); break;
    default: break;
  }
}

template <Kind K>
void many_rows(const Weight& w, const Rows& a, int64_t first, int64_t last, int64_t first_panel,
               int64_t last_panel, float* buffer) {
  int64_t p = first_panel;
  for (; p + 2 <= last_panel; p += 2) {
    expand_panels<2, K>(w, p, buffer);
    rows_from_buffer<2>(w, a, buffer, first, last, p);
  }
  if (p < last_panel) {
    expand_panels<1, K>(w, p, buffer);
    rows_from_buffer<1>(w, a, buffer, first, last, p);
  }
}

template <int R, int P, Kind K>
void panels_at(const Weight& w, const Rows& a, int64_t row, int64_t first_panel,
               int64_t last_panel) {
  int64_t p = first_panel;
  for (; p + P <= last_panel; p += P) tile<R, P, K>(w, a, row, p);
  for (; p < last_panel; ++p) tile<R, 1, K>(w, a, row, p);
}


#ifdef ASERVE_AVX512
// With AVX-512 `tile`'s work two panels at a time, one panel in each half of a 512-bit
// register: per lane the same operations in the same order, so the same bits.
inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

inline __m512 join(__m256 low, __m256 high) {
  const __m512d joined = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)),
                                            _mm256_castps_pd(high), 1);
  return _mm512_castpd_ps(joined);
}

// A 4-bit code c (or its level) as a float in one instruction: `vpermps` reads only the low
// four bits of each lane's index, so a word shifted right by 4i picks entry c of a 16-float
// table (c itself, or levels[c]). The same floats as the shift, mask and magic-number
// conversion of `code_of`, in one instruction instead of four.
template <Kind K>
inline __m512 code_table(const Weight& w) {
  if (K != Kind::kLevels)
    return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float values[16];
  for (int c = 0; c < 16; ++c) values[c] = static_cast<float>(w.levels[c]) - 128.0f;
  return _mm512_load_ps(values);
}

// `code_of` over 16 lanes. Split codes (`high`, input i's two high bits at bits 2i, 2i + 1):
// the low four bits and the two high ones side by side (one bit select), in the mantissa of
// 2^23 (one mask and or), minus 2^23 and the center (`bias`); simple integer operations
// where two table lookups had queued on the one port that permutes.
template <Kind K>
inline __m512 code_of2(__m512i word, int i, __m512 table, __m512i high = _mm512_setzero_si512(),
                       __m512 bias = _mm512_setzero_ps()) {
  if (K == Kind::kSplit) {
    const __m512i low = _mm512_srli_epi32(word, 4 * i);
    const __m512i top = 2 * i <= 4 ? _mm512_slli_epi32(high, 4 - 2 * i) : _mm512_srli_epi32(high, 2 * i - 4);
    // bits 0-3 from low, the rest from top (0xE4: c ? a : b, c the mask)
    const __m512i code = _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi32(15), 0xE4);
    // (code & 63) | 2^23's bits (0xEA: (a & b) | c)
    const __m512i mantissa = _mm512_ternarylogic_epi32(code, _mm512_set1_epi32(63),
                                                       _mm512_set1_epi32(0x4B000000), 0xEA);
    return _mm512_sub_ps(_mm512_castsi512_ps(mantissa), bias);
  }
  if (K != Kind::kBytes) return _mm512_permutexvar_ps(_mm512_srli_epi32(word, 4 * i), table);
  const __m512i magic = _mm512_set1_epi32(0x4B000000);
  const __m512i flipped = _mm512_xor_si512(word, _mm512_set1_epi32(0x80808080));
  const __m512i code = _mm512_and_si512(_mm512_srli_epi32(flipped, 8 * i), _mm512_set1_epi32(255));
  return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_or_si512(code, magic)), _mm512_set1_ps(8388736.0f));
}

// The scales (`which` 0) or offsets (1) of two panels' group at spots s and s2, as 16 floats:
// a pair, or one panel twice (s2 = s) for an odd panel at a weight's end. Int8 steps
// (K-quants) are multiplied by their block's base, as `value` does.
ASERVE_INLINE __m512 pair_values(const Weight& w, int which, const Weight::Spot& s,
                                 const Weight::Spot& s2) {
  const void* values = which ? w.offsets : w.scales;
  if (w.scale_kind != ScaleKind::kSteps)
    return join(w.lanes(values, which, s), w.lanes(values, which, s2));
  const int8_t* steps = static_cast<const int8_t*>(values);
  const __m128i both =
      _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(steps + s.at)),
                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(steps + s2.at)));
  const __m512 base =
      join(Weight::bases8(s.base + which * kLanes), Weight::bases8(s2.base + which * kLanes));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both)), base);
}

// Group g's parts of R rows against Q panel pairs (from first_panel; with `single`, Q = 1 and
// the one panel as a pair of itself) folded into their totals, each pair's scales and offsets
// read once for all R rows: total = fma(scale, part, total), then fma(offset, xsum, total).
template <int R, int Q>
ASERVE_INLINE void close_pairs(const Weight& w, const Rows& a, int64_t first_row,
                               int64_t first_panel, int64_t g, bool single,
                               const __m512 (&part)[R][Q], __m512 (&total)[R][Q]) {
#pragma GCC unroll 8
  for (int q = 0; q < Q; ++q) {
    const int64_t p = first_panel + 2 * q;
    const Weight::Spot s = w.spot(p, g), s2 = single ? s : w.next_spot(s, p, g);
    const __m512 scale = pair_values(w, 0, s, s2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) total[r][q] = _mm512_fmadd_ps(scale, part[r][q], total[r][q]);
    if (w.offsets == nullptr) continue;
    const __m512 offset = pair_values(w, 1, s, s2);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      total[r][q] = _mm512_fmadd_ps(
          offset, _mm512_set1_ps(a.xsum[(first_row + r) * a.groups + g]), total[r][q]);
  }
}

// The totals of R rows against Q panel pairs into y (with `single`, the first panel's only).
template <int R, int Q>
ASERVE_INLINE void store_pairs(const Rows& a, int64_t first_row, int64_t first_panel, bool single,
                               const __m512 (&total)[R][Q]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) {
      float* y = a.y + (first_row + r) * a.out + (first_panel + 2 * q) * kLanes;
      _mm256_storeu_ps(y, _mm512_castps512_ps256(total[r][q]));
      if (single) continue;
      _mm256_storeu_ps(y + kLanes,
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(total[r][q]), 1)));
    }
}

// R rows against panels [first_panel, first_panel + 2 * Q).
template <int R, int Q, Kind K>
void tile2(const Weight& w, const Rows& a, int64_t first_row, int64_t first_panel) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const __m512 table = code_table<K>(w);
  const __m512 bias = _mm512_set1_ps(8388608.0f + static_cast<float>(split_center(w)));
  const int64_t words = w.words_per_group(), code_words = w.code_words(), stride = w.panel_words();
  const float* x[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) x[r] = a.row(first_row + r);
  __m512 total[R][Q];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) total[r][q] = _mm512_setzero_ps();
  // as in `int_tile2`: a row block's first tile asks for the next panels
  NextPanels next(w, first_panel + 2 * Q, 2 * Q, asks_ahead<R>(first_row % kRowBlock == 0));
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    __m512 part[R][Q];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) part[r][q] = _mm512_setzero_ps();
    for (int64_t v = 0; v < code_words; ++v) {
      const int64_t k0 = g * w.group + v * per_word;
      __m512i word[Q], high[Q];
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) {
        const uint32_t* low = w.words + (first_panel + 2 * q) * stride + g * words * kLanes;
        auto pair_at = [&](int64_t at) {
          return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + at * kLanes)),
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + stride + at * kLanes)));
        };
        word[q] = pair_at(v);
        high[q] = K == Kind::kSplit ? _mm512_srli_epi32(pair_at(code_words + v / 2), 16 * (v % 2))
                                    : _mm512_setzero_si512();
      }
#pragma GCC unroll 8
      for (int i = 0; i < per_word; ++i) {
#pragma GCC unroll 8
        for (int q = 0; q < Q; ++q) {
          const __m512 code = code_of2<K>(word[q], i, table, high[q], bias);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const __m512 xk = _mm512_set1_ps(x[r][k0 + i]);
            part[r][q] = _mm512_fmadd_ps(code, xk, part[r][q]);
          }
        }
      }
    }
    close_pairs(w, a, first_row, first_panel, g, false, part, total);
  }
  store_pairs(a, first_row, first_panel, false, total);
}

#ifdef ASERVE_VNNI
// Inputs [0, n) of x (n = 16 or 32; the rest read as zero) into one block.
inline void quantize_block(const float* x, int n, bool bytes, int32_t* words, float* scale,
                           int32_t* sums) {
  const __m512 first = _mm512_loadu_ps(x);
  const __m512 second = n == 32 ? _mm512_loadu_ps(x + 16) : _mm512_setzero_ps();
  const float largest =
      _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(first), _mm512_abs_ps(second)));
  const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? kIntLimit / largest : 0.0f);
  *scale = largest / kIntLimit;
  const __m128i even_odd = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int half = 0; half < n / 16; ++half) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(half ? second : first, inverse));
    sums[half] = _mm512_reduce_add_epi32(v);
    const __m512i lo = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
    const __m512i hi = _mm512_srai_epi32(_mm512_sub_epi32(v, lo), 8);
    __m128i h = _mm512_cvtepi32_epi8(hi), l = _mm512_cvtepi32_epi8(lo);
    if (!bytes) {
      h = _mm_shuffle_epi8(h, even_odd);
      l = _mm_shuffle_epi8(l, even_odd);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + 8 * half), _mm_unpacklo_epi32(h, l));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + 8 * half + 4), _mm_unpackhi_epi32(h, l));
  }
}

// Bits 4 and 5 of a split code's bytes: `vpmultishiftqb` gives each byte the 8 bits of its 64-bit
// lane from an offset, so these offsets put the high bits of inputs 0, 2, 4, 6 of a word
// (bits 2i, 2i + 1 of `high`, one 32-bit lane's) at bits 4 and 5 of bytes 0 to 3; the odd
// inputs' two bits later.
inline __m512i split_offsets(int odd) {
  const int8_t o = static_cast<int8_t>(2 * odd);
  return _mm512_set1_epi64(static_cast<int64_t>(
      (uint64_t{static_cast<uint8_t>((60 + o) % 64)}) | (uint64_t{static_cast<uint8_t>(0 + o)} << 8) |
      (uint64_t{static_cast<uint8_t>(4 + o)} << 16) | (uint64_t{static_cast<uint8_t>(8 + o)} << 24) |
      (uint64_t{static_cast<uint8_t>(28 + o)} << 32) | (uint64_t{static_cast<uint8_t>(32 + o)} << 40) |
      (uint64_t{static_cast<uint8_t>(36 + o)} << 48) | (uint64_t{static_cast<uint8_t>(40 + o)} << 56)));
}

// A code word (`word`, two panels) as two registers of unsigned code bytes, the even inputs'
// and the odd inputs' (for 8-bit codes, the word's four inputs in `even`).
struct CodeBytes {
  __m512i even, odd;
};

// `code_bytes`' table: the 16 level bytes in each 128-bit lane for levels, else zeros.
template <Kind K>
inline __m512i level_table(const Weight& w) {
  if (K != Kind::kLevels) return _mm512_setzero_si512();
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.levels)));
}

template <Kind K>
inline CodeBytes code_bytes(__m512i word, __m512i high, __m512i table) {
  const __m512i nibbles = _mm512_set1_epi8(15);
  if (K == Kind::kBytes) {
    const __m512i flipped = _mm512_xor_si512(word, _mm512_set1_epi8(static_cast<char>(0x80)));
    return {flipped, flipped};
  }
  const __m512i even = _mm512_and_si512(word, nibbles);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(word, 4), nibbles);
  if (K == Kind::kLevels) return {_mm512_shuffle_epi8(table, even), _mm512_shuffle_epi8(table, odd)};
  if (K == Kind::kNibbles) return {even, odd};
#ifdef __AVX512VBMI__
  // low nibble from the code word, bits 4 and 5 from the high bits (0xE4: c ? a : b)
  const __m512i six = _mm512_set1_epi8(63);
  const __m512i top_even = _mm512_multishift_epi64_epi8(split_offsets(0), high);
  const __m512i top_odd = _mm512_multishift_epi64_epi8(split_offsets(1), high);
  return {_mm512_and_si512(_mm512_ternarylogic_epi32(even, top_even, nibbles, 0xE4), six),
          _mm512_and_si512(_mm512_ternarylogic_epi32(odd, top_odd, nibbles, 0xE4), six)};
#else
  return {even, odd};  // not reached: `int_kind` leaves split codes to the float tiles
#endif
}

// hi += codes.even . x[0] + codes.odd . x[2] and lo += codes.even . x[1] + codes.odd . x[3], each
// x[i] four signed bytes broadcast to the 16 lanes (`vpdpbusd`). Split codes' tiles take it in
// asm, x read as broadcast memory operands: through the intrinsics GCC kept their sums in two
// registers each, copying them from one to the other at every step of the inner loop (64 rows,
// one thread: Q6_K 98 -> 111 GMAC/s); the other codes' tiles lost 3-15% in asm and keep them.
ASERVE_INLINE void dot_bytes4(__m512i& hi, __m512i& lo, const CodeBytes& codes, const int32_t* x) {
  asm("vpdpbusd (%4)%{1to16%}, %2, %0\n\t"
      "vpdpbusd 4(%4)%{1to16%}, %2, %1\n\t"
      "vpdpbusd 8(%4)%{1to16%}, %3, %0\n\t"
      "vpdpbusd 12(%4)%{1to16%}, %3, %1"
      : "+v"(hi), "+v"(lo)
      : "v"(codes.even), "v"(codes.odd), "r"(x), "m"(*reinterpret_cast<const int32_t(*)[4]>(x)));
}

// R rows against panels [first_panel, first_panel + 2 * Q), activations as integers; with
// `single` (Q = 1) the one panel first_panel, computed as a pair of itself. `kThree`: a
// `three_bit` weight's codes, each nibble word made in registers from the pair of groups'
// low and high words (`widen_three` says how).
template <int R, int Q, Kind K, bool kThree = false>
void int_tile2(const Weight& w, const Rows& a, int64_t first_row, int64_t first_panel,
               bool single = false) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const int64_t words = w.words_per_group(), code_words = w.code_words(), stride = w.panel_words();
  const int64_t low_words = w.group / 16;  // kThree: a group's low words
  const int bias = code_bias<K>(w);
  const __m512i table = level_table<K>(w);
  const int64_t row_words = a.cols / 2;
  const int64_t second = single ? 0 : stride;  // from a panel's words to its pair's
  __m512 total[R][Q];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) total[r][q] = _mm512_setzero_ps();
  // the next panels' bytes asked for by a row block's first tile only: the tiles after it
  // read the same panels from cache, and their prefetches had cost 15% of a 128-row product
  NextPanels next(w, first_panel + 2 * Q, 2 * Q, asks_ahead<R>(first_row % kRowBlock == 0));
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    __m512i hi[R][Q], lo[R][Q];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) hi[r][q] = lo[r][q] = _mm512_setzero_si512();
    // a code word's products. Unrolled by four, GCC stopped copying the tiles' sums between
    // registers at every word (one thread, 64 rows, GMAC/s: Q8_0 127 -> 171, Q4_0 154 -> 169);
    // split codes lost that way (108 -> 88) and keep the loop rolled.
    const auto add_word = [&](int64_t v) __attribute__((always_inline)) {
      const int64_t at = (g * w.group + v * per_word) / 2;  // the row's first word for v
      CodeBytes codes[Q];
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) {
        const int64_t group_at = kThree ? g / 2 * 3 * low_words : g * words;
        const uint32_t* low = w.words + (first_panel + 2 * q) * stride + group_at * kLanes;
        auto pair_at = [&](int64_t word) {
          return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + word * kLanes)),
                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + second + word * kLanes)));
        };
        const __m512i high = K == Kind::kSplit
                                 ? _mm512_srli_epi32(pair_at(code_words + v / 2), 16 * (v % 2))
                                 : _mm512_setzero_si512();
        if constexpr (kThree) {
          // nibble word n of the pair: low word n / 2 shifted by 2 (n % 2), high word n / 4
          // with bit n % 4 of each nibble moved to bit 2
          const int64_t n = g % 2 * code_words + v;
          const int top = static_cast<int>(n % 4);
          const __m512i bits = pair_at(2 * low_words + n / 4);
          const __m512i moved =
              top <= 2 ? _mm512_slli_epi32(bits, 2 - top) : _mm512_srli_epi32(bits, top - 2);
          const __m512i word = _mm512_or_si512(
              _mm512_and_si512(_mm512_srli_epi32(pair_at(n / 2), static_cast<int>(2 * (n % 2))),
                               _mm512_set1_epi32(0x33333333)),
              _mm512_and_si512(moved, _mm512_set1_epi32(0x44444444)));
          codes[q] = code_bytes<K>(word, high, table);
        } else {
          codes[q] = code_bytes<K>(pair_at(v), high, table);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* x = a.xq + (first_row + r) * row_words + at;
#pragma GCC unroll 8
        for (int q = 0; q < Q; ++q) {
          if (K == Kind::kSplit) {
            dot_bytes4(hi[r][q], lo[r][q], codes[q], x);
          } else {
            hi[r][q] = _mm512_dpbusd_epi32(hi[r][q], codes[q].even, _mm512_set1_epi32(x[0]));
            lo[r][q] = _mm512_dpbusd_epi32(lo[r][q], codes[q].even, _mm512_set1_epi32(x[1]));
            if (K != Kind::kBytes) {
              hi[r][q] = _mm512_dpbusd_epi32(hi[r][q], codes[q].odd, _mm512_set1_epi32(x[2]));
              lo[r][q] = _mm512_dpbusd_epi32(lo[r][q], codes[q].odd, _mm512_set1_epi32(x[3]));
            }
          }
        }
      }
    };
    if constexpr (K == Kind::kSplit) {
      for (int64_t v = 0; v < code_words; ++v) add_word(v);
    } else {
#pragma GCC unroll 4
      for (int64_t v = 0; v < code_words; ++v) add_word(v);
    }
    __m512 part[R][Q];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const auto [sum_shift, scale] = group_shift_and_scale(a, first_row + r, g, w.group, bias);
      const __m512i shift = _mm512_set1_epi32(sum_shift);
      const __m512 xs = _mm512_set1_ps(scale);
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) {
        const __m512i exact =
            _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(hi[r][q], 8), lo[r][q]), shift);
        part[r][q] = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), xs);
      }
    }
    close_pairs(w, a, first_row, first_panel, g, single, part, total);
  }
  store_pairs(a, first_row, first_panel, single, total);
}
#endif

// R rows against panels [first_panel, last_panel): Q pairs at a time, then single pairs, then
// an odd panel alone; `kInt`: with activations as integers (`int_tile2`).
template <int R, int Q, Kind K, bool kInt, bool kThree = false>
void panels_at2(const Weight& w, const Rows& a, int64_t row, int64_t first_panel,
                int64_t last_panel) {
  int64_t p = first_panel;
#ifdef ASERVE_VNNI
  if constexpr (kInt) {
    for (; p + 2 * Q <= last_panel; p += 2 * Q) int_tile2<R, Q, K, kThree>(w, a, row, p);
    for (; p + 2 <= last_panel; p += 2) int_tile2<R, 1, K, kThree>(w, a, row, p);
    if (p < last_panel) int_tile2<R, 1, K, kThree>(w, a, row, p, true);
    return;
  }
#endif
  for (; p + 2 * Q <= last_panel; p += 2 * Q) tile2<R, Q, K>(w, a, row, p);
  for (; p + 2 <= last_panel; p += 2) tile2<R, 1, K>(w, a, row, p);
  for (; p < last_panel; ++p) tile<R, 1, K>(w, a, row, p);
}

// Rows a tile of two panel pairs takes. The integer tiles take three: with four, their 16 sums,
// the codes and the rows' broadcast bytes outgrew the 32 registers, and GCC spilled sums and
// moved them between registers inside the inner loop (64 rows, one thread, GMAC/s: Q4_K 137 ->
// 152, Q4_0 144 -> 160, Q8_0 130 -> 132). Split codes, whose sums go through `dot_bytes4`,
// keep four (three: 111 -> 91).
template <Kind K, bool kInt>
constexpr int kTileRows = kInt && K != Kind::kSplit ? 3 : 4;

template <Kind K, bool kInt = false, bool kThree = false>
void few_rows(const Weight& w, const Rows& a, int64_t first, int64_t last, int64_t first_panel,
              int64_t last_panel) {
  constexpr int R = kTileRows<K, kInt>;
  int64_t row = first;
  for (; row + R <= last; row += R)
    panels_at2<R, 2, K, kInt, kThree>(w, a, row, first_panel, last_panel);
  if (row + 2 <= last) {
    panels_at2<2, 2, K, kInt, kThree>(w, a, row, first_panel, last_panel);
    row += 2;
  }
  if (row < last) panels_at2<1, 4, K, kInt, kThree>(w, a, row, first_panel, last_panel);
}
#ifdef ASERVE_AMX
// AMX's integer tiles for many rows of 4-bit codes, level bytes and split codes (Sapphire
// Rapids and later Xeons; not 8-bit codes, nor the codes widened from 3 bits or books). A tile
// multiplies signed bytes by unsigned bytes into int32 sums exactly, as `vpdpbusd` does, so
// each group's sums are `int_tile2`'s `hi` and `lo` to the bit, and the float steps after them
// are its own: a row's outputs keep their bits whichever path takes them. On a 2-core Xeon
// (bench/NOTES.md) a 512-row product of 8,192 x 2,048 Q4_K codes took 57-59 ms through the
// VNNI tiles and 45 through these; the tiles alone 21 of it, the float steps alone 27, which
// the tiles of the next group now overlap (49 ms when each group waited on its own tiles).
// A first version, which made each tile's activation bytes and codes again for every 16 rows
// and panel pair, gained nothing. The 1B Q4_K_M file's 16 x 128-token prefill: 15.0-15.7 ->
// 12.9 s.
bool amx_on = true;

// Whether this process may use the tiles: Linux grants their state on request, once.
bool amx_granted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

bool amx_tiles(std::optional<bool> enable) {
  if (enable.has_value()) amx_on = *enable;
  return amx_on && amx_granted();
}

struct TileShapes {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_a_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 and 1: 16 rows' high and low activation bytes of a group; 2: a panel pair's codes
// of the group, four inputs a row (16 lanes x 4 bytes); 3 and 4, or 5 and 6: the high and low
// sums (`amx_sums`).
void configure_tiles(int64_t group) {
  TileShapes shapes;
  for (int t : {0, 1}) shapes.rows[t] = 16, shapes.bytes_a_row[t] = static_cast<uint16_t>(group);
  shapes.rows[2] = static_cast<uint8_t>(group / 4), shapes.bytes_a_row[2] = 64;
  for (int t : {3, 4, 5, 6}) shapes.rows[t] = 16, shapes.bytes_a_row[t] = 64;
  // as asm reading the whole struct: through `_tile_loadconfig` GCC 12 dropped the stores of
  // the shapes (the intrinsic is not known to read them) and the instruction faulted
  asm volatile("ldtilecfg %0" : : "m"(shapes));
}

// A row's `xq` words in the order the tiles read them (`Rows::xt`): a row's words of a group
// are (x0, x1, x2, x3) for each code word v, `int_tile2` adding even codes times x0 (high
// bytes) and x1 (low), odd codes times x2 and x3; here each group's high words (x0, x2 of
// every code word) come first, then its low ones, so 16 rows' high or low bytes of a group are
// one tile. Made once a product, not once a tile.
void tile_order(const int32_t* xq, int64_t words, int64_t group_words, int32_t* xt) {
  for (int64_t g = 0; g < words; g += group_words)
    for (int64_t i = 0; i < group_words / 2; ++i) {
      xt[g + i] = xq[g + 2 * i];
      xt[g + group_words / 2 + i] = xq[g + 2 * i + 1];
    }
}

// A panel pair's codes of every group as tile 2 takes them: the code words' even and odd
// inputs' unsigned code bytes (`code_bytes`: nibbles, level bytes, split codes with their
// high bits; four inputs a lane each) as rows in turn, 64 bytes a row.
template <Kind K>
void pair_codes(const Weight& w, int64_t p, uint8_t* codes) {
  const int64_t words = w.words_per_group(), code_words = w.code_words(), stride = w.panel_words();
  const __m512i table = level_table<K>(w);
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint32_t* low = w.words + p * stride + g * words * kLanes;
    auto pair_at = [&](int64_t word) {
      return join(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + word * kLanes)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + stride + word * kLanes)));
    };
    uint8_t* rows = codes + g * code_words * 128;
    for (int64_t v = 0; v < code_words; ++v) {
      const __m512i high = K == Kind::kSplit
                               ? _mm512_srli_epi32(pair_at(code_words + v / 2), 16 * (v % 2))
                               : _mm512_setzero_si512();
      const CodeBytes bytes = code_bytes<K>(pair_at(v), high, table);
      _mm512_storeu_si512(rows + 128 * v, bytes.even);
      _mm512_storeu_si512(rows + 128 * v + 64, bytes.odd);
    }
  }
}

// Group g's tile products of rows [first, first + 16) into sums[0] (high) and sums[1] (low):
// into C tiles 3 and 4, or 5 and 6 (`kSecond`), so that the next group's products run on the
// tile unit while this group's float steps run on the vector units. (GCC's tile intrinsics
// paste the tile's number into their asm text: it cannot be a template argument.)
template <bool kSecond>
ASERVE_INLINE void amx_sums(const Weight& w, const int32_t* x, int64_t row_words,
                            const uint8_t* codes, int64_t g, int32_t (*sums)[16][16]) {
  const int64_t group_words = w.group / 2;
  _tile_loadd(0, x + g * group_words, row_words * 4);
  _tile_loadd(1, x + g * group_words + group_words / 2, row_words * 4);
  _tile_loadd(2, codes + g * w.code_words() * 128, 64);
  if constexpr (kSecond) {
    _tile_zero(5);
    _tile_zero(6);
    _tile_dpbsud(5, 0, 2);
    _tile_dpbsud(6, 1, 2);
    _tile_stored(5, sums[0][0], 64);
    _tile_stored(6, sums[1][0], 64);
  } else {
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbsud(3, 0, 2);
    _tile_dpbsud(4, 1, 2);
    _tile_stored(3, sums[0][0], 64);
    _tile_stored(4, sums[1][0], 64);
  }
}

// Rows [first, first + 16) against the panel pair p, its codes from `pair_codes`: each
// group's sums are `int_tile2`'s `hi` and `lo` to the bit, closed by its float steps.
template <Kind K>
void amx_block(const Weight& w, const Rows& a, int64_t first, int64_t p, const uint8_t* codes) {
  const int bias = code_bias<K>(w);
  const int64_t row_words = a.cols / 2;
  const int32_t* x = a.xt + first * row_words;
  alignas(64) int32_t sums[2][2][16][16];  // [group % 2][high, low][row][lane]
  __m512 total[16][1];
  for (int r = 0; r < 16; ++r) total[r][0] = _mm512_setzero_ps();
  amx_sums<false>(w, x, row_words, codes, 0, sums[0]);
  for (int64_t g = 0; g < w.groups; ++g) {
    if (g + 1 < w.groups) {
      if (g % 2 == 0) amx_sums<true>(w, x, row_words, codes, g + 1, sums[1]);
      else amx_sums<false>(w, x, row_words, codes, g + 1, sums[0]);
    }
    const int32_t(*hi)[16] = sums[g % 2][0], (*lo)[16] = sums[g % 2][1];
    __m512 part[16][1];
    for (int r = 0; r < 16; ++r) {
      const auto [sum_shift, scale] = group_shift_and_scale(a, first + r, g, w.group, bias);
      const __m512i exact = _mm512_sub_epi32(
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(hi[r]), 8),
                           _mm512_load_si512(lo[r])),
          _mm512_set1_epi32(sum_shift));
      part[r][0] = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(scale));
    }
    close_pairs(w, a, first, p, g, false, part, total);
  }
  store_pairs(a, first, p, false, total);
}

// Rows [first, last) against panels [first_panel, last_panel): blocks of 16
// rows and pairs of panels through the tiles, each pair's codes made once for all its row
// blocks; the rest through `few_rows` as before.
template <Kind K>
void amx_rows(const Weight& w, const Rows& a, int64_t first, int64_t last, int64_t first_panel,
              int64_t last_panel) {
  const int64_t blocks_end = first + (last - first) / 16 * 16;
  const int64_t pairs_end = first_panel + (last_panel - first_panel) / 2 * 2;
  thread_local std::vector<uint8_t> codes;
  codes.resize(w.groups * w.code_words() * 128);
  configure_tiles(w.group);
  for (int64_t p = first_panel; p < pairs_end; p += 2) {
    pair_codes<K>(w, p, codes.data());
    for (int64_t row = first; row < blocks_end; row += 16) amx_block<K>(w, a, row, p, codes.data());
  }
  _tile_release();
  if (pairs_end < last_panel) few_rows<K, true>(w, a, first, blocks_end, pairs_end, last_panel);
  if (blocks_end < last) few_rows<K, true>(w, a, blocks_end, last, first_panel, last_panel);
}
#endif

#else
template <Kind K>
void few_rows(const Weight& w, const Rows& a, int64_t first, int64_t last, int64_t first_panel,
              int64_t last_panel) {
  int64_t row = first;
  for (; row + 4 <= last; row += 4) panels_at<4, 1, K>(w, a, row, first_panel, last_panel);
  if (row + 2 <= last) {
    panels_at<2, 2, K>(w, a, row, first_panel, last_panel);
    row += 2;
  }
  if (row < last) panels_at<1, 4, K>(w, a, row, first_panel, last_panel);
}

#ifdef ASERVE_INT256
// `IntActivations` on CPUs with AVX-VNNI but not AVX-512 (Intel's cores since Alder Lake): one
// panel a 256-bit register, the same integers and per output the same float operations as
// `int_tile2`, so the same bits. The float tiles expand each code to a float and multiply it
// with an FMA, five instructions for 8 products; here four `vpdpbusd` take 64.

// Inputs [0, n) of x (n = 16 or 32; the rest read as zero) into one block, as the AVX-512
// `quantize_block` does: the same scale, integers and word layout, or with `pairs` (`kPairs`)
// each integer whole in 16 bits, two a word in the order of `code_pairs`' halves.
inline void quantize_block(const float* x, int n, bool bytes, bool pairs, int32_t* words,
                           float* scale, int32_t* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 values[4], largest8 = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    values[i] = 8 * i < n ? _mm256_loadu_ps(x + 8 * i) : _mm256_setzero_ps();
    largest8 = _mm256_max_ps(largest8, _mm256_and_ps(values[i], magnitude));
  }
  __m128 largest4 = _mm_max_ps(_mm256_castps256_ps128(largest8), _mm256_extractf128_ps(largest8, 1));
  largest4 = _mm_max_ps(largest4, _mm_movehl_ps(largest4, largest4));
  const float largest = _mm_cvtss_f32(_mm_max_ss(largest4, _mm_movehdup_ps(largest4)));
  const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? kIntLimit / largest : 0.0f);
  *scale = largest / kIntLimit;
  alignas(32) int32_t steps[32];
  for (int i = 0; i < n / 8; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(steps + 8 * i),
                       _mm256_cvtps_epi32(_mm256_mul_ps(values[i], inverse)));
  for (int half = 0; half < n / 16; ++half) {
    int32_t sum = 0;
    for (int i = 0; i < 16; ++i) sum += steps[16 * half + i];
    sums[half] = sum;
    for (int eight = 0; eight < 2; ++eight) {
      const int32_t* step = steps + 16 * half + 8 * eight;
      int32_t* out = words + 8 * half + 4 * eight;
      if (pairs) {
        // 8-bit codes: inputs 0 and 2, then 1 and 3, of each 4; levels: 0 and 4, 2 and 6,
        // 1 and 5, 3 and 7 of the 8
        static constexpr int kBytePairs[4][2] = {{0, 2}, {1, 3}, {4, 6}, {5, 7}};
        static constexpr int kLevelPairs[4][2] = {{0, 4}, {2, 6}, {1, 5}, {3, 7}};
        const auto& order = bytes ? kBytePairs : kLevelPairs;
        for (int j = 0; j < 4; ++j)
          out[j] = static_cast<int32_t>(static_cast<uint16_t>(step[order[j][0]]) |
                                        static_cast<uint32_t>(static_cast<uint16_t>(step[order[j][1]])) << 16);
        continue;
      }
      for (int odd = 0; odd < 2; ++odd) {  // the even inputs (8-bit codes: the first four)
        uint32_t hi = 0, lo = 0;
        for (int j = 0; j < 4; ++j) {
          const int32_t value = step[bytes ? 4 * odd + j : 2 * j + odd];
          const int32_t low = static_cast<int8_t>(value & 255);
          hi |= static_cast<uint32_t>(static_cast<uint8_t>((value - low) >> 8)) << (8 * j);
          lo |= static_cast<uint32_t>(static_cast<uint8_t>(low)) << (8 * j);
        }
        out[2 * odd] = static_cast<int32_t>(hi);
        out[2 * odd + 1] = static_cast<int32_t>(lo);
      }
    }
  }
}

// A panel's code word as unsigned code bytes, the even inputs' and the odd inputs' (8-bit
// codes: the word's four inputs in `even`); split codes with bits 4 and 5 from `high`, the
// word's inputs' high bits (input i at bits 2i, 2i + 1 of each lane's low 16 bits).
struct CodeBytes8 {
  __m256i even, odd;
};

template <Kind K>
inline CodeBytes8 code_bytes8(__m256i word, __m256i high, int half, __m256i levels) {
  if (K == Kind::kBytes) {
    const __m256i flipped = _mm256_xor_si256(word, _mm256_set1_epi8(static_cast<char>(0x80)));
    return {flipped, flipped};
  }
  const __m256i nibbles = _mm256_set1_epi8(15);
  const __m256i even = _mm256_and_si256(word, nibbles);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(word, 4), nibbles);
  if (K == Kind::kLevels) return {_mm256_shuffle_epi8(levels, even), _mm256_shuffle_epi8(levels, odd)};
  if (K != Kind::kSplit) return {even, odd};
  // Code byte j of the even inputs (input 2j) takes bits 4j, 4j + 1 of `high`, the odd
  // inputs' bits 4j + 2, 4j + 3: nibble j of `high`'s 16 bits, low two bits for the even
  // input, high two for the odd. Nibble j to byte j (bytes 0, 0, 1, 1 of the lane's half side
  // by side, then the odd bytes' high nibbles), then two table lookups put each input's two
  // bits at 4 and 5.
  const __m256i twice = _mm256_shuffle_epi8(
      high, half == 0 ? _mm256_setr_epi8(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13, 0, 0,
                                         1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13)
                      : _mm256_setr_epi8(2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15, 2,
                                         2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15));
  const __m256i nibble =
      _mm256_or_si256(_mm256_and_si256(twice, _mm256_set1_epi32(0x000f000f)),
                      _mm256_and_si256(_mm256_srli_epi16(twice, 4), _mm256_set1_epi32(0x0f000f00)));
  const __m256i low_pair = _mm256_setr_epi8(0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32,
                                            48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16, 32, 48, 0, 16,
                                            32, 48);
  const __m256i high_pair = _mm256_setr_epi8(0, 0, 0, 0, 16, 16, 16, 16, 32, 32, 32, 32, 48, 48, 48,
                                             48, 0, 0, 0, 0, 16, 16, 16, 16, 32, 32, 32, 32, 48, 48,
                                             48, 48);
  const __m256i even_high = _mm256_shuffle_epi8(low_pair, nibble);
  const __m256i odd_high = _mm256_shuffle_epi8(high_pair, nibble);
  return {_mm256_or_si256(even, even_high), _mm256_or_si256(odd, odd_high)};
}

// A panel's code word as 16-bit codes (`kPairs`), each 32-bit lane two inputs' in the order
// that `quantize_block` pairs the activations: 8-bit codes' inputs 0 and 2, 1 and 3; levels'
// 0 and 4, 2 and 6, 1 and 5, 3 and 7 (the even and odd inputs' level bytes, each 16 bits
// split into its low and high byte by shifts, sign-extended). `levels`: the signed levels.
struct CodePairs {
  __m256i pair[4];  // 8-bit codes: the first two
};

template <Kind K>
ASERVE_INLINE CodePairs code_pairs(__m256i word, __m256i levels) {
  const auto low = [](__m256i b) { return _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8); };
  const auto high = [](__m256i b) { return _mm256_srai_epi16(b, 8); };
  if (K == Kind::kBytes) return {low(word), high(word), word, word};  // stored as signed bytes
  const __m256i nibbles = _mm256_set1_epi8(15);
  const __m256i even = _mm256_shuffle_epi8(levels, _mm256_and_si256(word, nibbles));
  const __m256i odd =
      _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi32(word, 4), nibbles));
  return {low(even), high(even), low(odd), high(odd)};
}

// What the tiles multiply a code word of kind K as.
template <Kind K>
using TileCodes = std::conditional_t<kPairs<K>, CodePairs, CodeBytes8>;

// The level bytes as the tiles of kind K read them (`word_codes`): signed for `kPairs`, else
// kept as level + 128.
template <Kind K>
inline __m256i tile_levels(const Weight& w) {
  const __m256i levels = levels_of(w);
  return kPairs<K> ? _mm256_xor_si256(levels, _mm256_set1_epi8(static_cast<char>(0x80))) : levels;
}

// A nibble word (of 4-bit codes or levels) as the tiles multiply it.
template <Kind K>
ASERVE_INLINE TileCodes<K> nibble_codes(__m256i word, __m256i levels) {
  if constexpr (kPairs<K>) return code_pairs<K>(word, levels);
  else return code_bytes8<K>(word, _mm256_setzero_si256(), 0, levels);
}

// Code word v of a panel's group (`group_words`, its first word; `code_words` a group's) as
// the tiles multiply it: its code bytes (`code_bytes8`) or 16-bit codes (`code_pairs`).
template <Kind K>
inline TileCodes<K> word_codes(const uint32_t* group_words, int64_t code_words, int64_t v,
                               __m256i levels) {
  const auto load = [&](int64_t at) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_words + at * kLanes));
  };
  if constexpr (kPairs<K>) {
    return code_pairs<K>(load(v), levels);
  } else {
    const __m256i high = K == Kind::kSplit ? load(code_words + v / 2) : _mm256_setzero_si256();
    return code_bytes8<K>(load(v), high, static_cast<int>(v % 2), levels);
  }
}

// One code word's products with a row's activation words `x` (hi and lo bytes of the even
// inputs, then of the odd ones; 8-bit codes: hi, lo) added to the hi and lo sums: in each
// 32-bit lane, four products of a code byte and an activation byte. AVX-VNNI's `vpdpbusd`
// does that in one instruction. Without it, `vpmaddubsw` adds two products into 16 bits and
// `vpmaddwd` two of those into 32: exact for codes up to 63 (4 x 63 x 128 < 2^15), so there
// levels and 8-bit codes (read as bytes up to 255) stay on the float tiles
// (`int_activations`); the even and odd inputs' 16-bit sums are added before widening.
// Without AVX-VNNI 4-bit codes keep a group's sums in 16 bits and widen them once, at its close
// (`group_sums`): a group's at most 32 inputs give at most 16 x 15 x 128 < 2^15 a lane.
template <Kind K>
constexpr bool kSumsIn16Bits =
#ifdef __AVXVNNI__
    false;
#else
    K == Kind::kNibbles;
#endif

template <Kind K>
ASERVE_INLINE void add_word(__m256i& hi, __m256i& lo, const CodeBytes8& codes, const int32_t* x) {
#ifdef __AVXVNNI__
  hi = _mm256_dpbusd_avx_epi32(hi, codes.even, _mm256_set1_epi32(x[0]));
  lo = _mm256_dpbusd_avx_epi32(lo, codes.even, _mm256_set1_epi32(x[1]));
  if (K != Kind::kBytes) {
    hi = _mm256_dpbusd_avx_epi32(hi, codes.odd, _mm256_set1_epi32(x[2]));
    lo = _mm256_dpbusd_avx_epi32(lo, codes.odd, _mm256_set1_epi32(x[3]));
  }
#else
  const auto pairs = [&](int even, int odd) {
    __m256i sums = _mm256_maddubs_epi16(codes.even, _mm256_set1_epi32(x[even]));
    if (K != Kind::kBytes)
      sums = _mm256_add_epi16(sums, _mm256_maddubs_epi16(codes.odd, _mm256_set1_epi32(x[odd])));
    return sums;
  };
  if (kSumsIn16Bits<K>) {
    hi = _mm256_add_epi16(hi, pairs(0, 2));
    lo = _mm256_add_epi16(lo, pairs(1, 3));
  } else {
    hi = _mm256_add_epi32(hi, _mm256_madd_epi16(pairs(0, 2), _mm256_set1_epi16(1)));
    lo = _mm256_add_epi32(lo, _mm256_madd_epi16(pairs(1, 3), _mm256_set1_epi16(1)));
  }
#endif
}

// `add_word` for `CodePairs`: each `vpmaddwd` adds two exact products of a 16-bit code and a
// 16-bit activation to a 32-bit lane (a group's at most 32 inputs: 32 x 128 x 32639 < 2^31),
// all into one sum (`int_tile` closes it unshifted). One chain of adds a tile's row and panel
// was as fast as two at one row and let 4-row tiles fit the registers.
template <Kind K>
ASERVE_INLINE void add_word(__m256i& sum, const CodePairs& codes, const int32_t* x) {
  sum = _mm256_add_epi32(sum, _mm256_madd_epi16(codes.pair[0], _mm256_set1_epi32(x[0])));
  sum = _mm256_add_epi32(sum, _mm256_madd_epi16(codes.pair[1], _mm256_set1_epi32(x[1])));
  if (K != Kind::kBytes) {
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(codes.pair[2], _mm256_set1_epi32(x[2])));
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(codes.pair[3], _mm256_set1_epi32(x[3])));
  }
}

// A group's hi or lo sums as `add_word` leaves them, in 32 bits.
template <Kind K>
inline __m256i group_sums(__m256i sums) {
  return kSumsIn16Bits<K> ? _mm256_madd_epi16(sums, _mm256_set1_epi16(1)) : sums;
}

#ifdef __AVXVNNI__
// `add_word` for one row and a pair of panels, in asm: through the intrinsics GCC copied the
// 2 x 2 tile's eight sums between registers at every step and spilled some (objdump), as it
// did in the AVX-512 tiles (`dot_bytes4`). One broadcast of each activation word serves both
// panels. 2 threads, AVX-VNNI build, GMAC/s at 16 / 128 rows: Q4_K 99 / 98 -> 119 / 123, Q6_K
// 69 / 73 -> 77 / 82, Q8_0 109 / 111 -> 140 / 147; levels (Q4_0, IQ4) lost 10% at 128 rows and
// 26% at one (their byte shuffles' table wants a register of its own) and keep the intrinsics.
template <Kind K>
ASERVE_INLINE void add_word_pair(__m256i& h0, __m256i& l0, __m256i& h1, __m256i& l1,
                                 const CodeBytes8& c0, const CodeBytes8& c1, const int32_t* x) {
  __m256i t;
  if constexpr (K == Kind::kBytes) {
    asm("vpbroadcastd (%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[e0], %[h0]\n\t"
        "%{vex%} vpdpbusd %[t], %[e1], %[h1]\n\t"
        "vpbroadcastd 4(%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[e0], %[l0]\n\t"
        "%{vex%} vpdpbusd %[t], %[e1], %[l1]"
        : [h0] "+x"(h0), [l0] "+x"(l0), [h1] "+x"(h1), [l1] "+x"(l1), [t] "=&x"(t)
        : [e0] "x"(c0.even), [e1] "x"(c1.even), [x] "r"(x),
          "m"(*reinterpret_cast<const int32_t(*)[2]>(x)));
  } else {
    asm("vpbroadcastd (%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[e0], %[h0]\n\t"
        "%{vex%} vpdpbusd %[t], %[e1], %[h1]\n\t"
        "vpbroadcastd 4(%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[e0], %[l0]\n\t"
        "%{vex%} vpdpbusd %[t], %[e1], %[l1]\n\t"
        "vpbroadcastd 8(%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[o0], %[h0]\n\t"
        "%{vex%} vpdpbusd %[t], %[o1], %[h1]\n\t"
        "vpbroadcastd 12(%[x]), %[t]\n\t"
        "%{vex%} vpdpbusd %[t], %[o0], %[l0]\n\t"
        "%{vex%} vpdpbusd %[t], %[o1], %[l1]"
        : [h0] "+x"(h0), [l0] "+x"(l0), [h1] "+x"(h1), [l1] "+x"(l1), [t] "=&x"(t)
        : [e0] "x"(c0.even), [o0] "x"(c0.odd), [e1] "x"(c1.even), [o1] "x"(c1.odd), [x] "r"(x),
          "m"(*reinterpret_cast<const int32_t(*)[4]>(x)));
  }
}
#else
// Without AVX-VNNI, `add_word`'s `vpmaddubsw` products for a pair of panels, 4-bit codes'
// sums kept in 16 bits, split codes' widened a word by `vpmaddwd` (GMAC/s at 16 / 128 rows:
// Q4_K 90 / 92 -> 102 / 105, Q5_K 72 / 79 -> 78 / 85, Q6_K 64 / 68 -> 67 / 74).
alignas(32) constexpr int16_t kOnes16[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

template <Kind K>
ASERVE_INLINE void add_word_pair(__m256i& h0, __m256i& l0, __m256i& h1, __m256i& l1,
                                 const CodeBytes8& c0, const CodeBytes8& c1, const int32_t* x) {
  __m256i t1, t2, s, u;
  if constexpr (K == Kind::kNibbles) {
    asm("vpbroadcastd (%[x]), %[t1]\n\t"
        "vpbroadcastd 8(%[x]), %[t2]\n\t"
        "vpmaddubsw %[t1], %[e0], %[s]\n\t"
        "vpmaddubsw %[t2], %[o0], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpaddw %[s], %[h0], %[h0]\n\t"
        "vpmaddubsw %[t1], %[e1], %[s]\n\t"
        "vpmaddubsw %[t2], %[o1], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpaddw %[s], %[h1], %[h1]\n\t"
        "vpbroadcastd 4(%[x]), %[t1]\n\t"
        "vpbroadcastd 12(%[x]), %[t2]\n\t"
        "vpmaddubsw %[t1], %[e0], %[s]\n\t"
        "vpmaddubsw %[t2], %[o0], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpaddw %[s], %[l0], %[l0]\n\t"
        "vpmaddubsw %[t1], %[e1], %[s]\n\t"
        "vpmaddubsw %[t2], %[o1], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpaddw %[s], %[l1], %[l1]"
        : [h0] "+x"(h0), [l0] "+x"(l0), [h1] "+x"(h1), [l1] "+x"(l1), [t1] "=&x"(t1),
          [t2] "=&x"(t2), [s] "=&x"(s), [u] "=&x"(u)
        : [e0] "x"(c0.even), [o0] "x"(c0.odd), [e1] "x"(c1.even), [o1] "x"(c1.odd), [x] "r"(x),
          "m"(*reinterpret_cast<const int32_t(*)[4]>(x)));
  } else {
    asm("vpbroadcastd (%[x]), %[t1]\n\t"
        "vpbroadcastd 8(%[x]), %[t2]\n\t"
        "vpmaddubsw %[t1], %[e0], %[s]\n\t"
        "vpmaddubsw %[t2], %[o0], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpmaddwd %[ones], %[s], %[s]\n\t"
        "vpaddd %[s], %[h0], %[h0]\n\t"
        "vpmaddubsw %[t1], %[e1], %[s]\n\t"
        "vpmaddubsw %[t2], %[o1], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpmaddwd %[ones], %[s], %[s]\n\t"
        "vpaddd %[s], %[h1], %[h1]\n\t"
        "vpbroadcastd 4(%[x]), %[t1]\n\t"
        "vpbroadcastd 12(%[x]), %[t2]\n\t"
        "vpmaddubsw %[t1], %[e0], %[s]\n\t"
        "vpmaddubsw %[t2], %[o0], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpmaddwd %[ones], %[s], %[s]\n\t"
        "vpaddd %[s], %[l0], %[l0]\n\t"
        "vpmaddubsw %[t1], %[e1], %[s]\n\t"
        "vpmaddubsw %[t2], %[o1], %[u]\n\t"
        "vpaddw %[u], %[s], %[s]\n\t"
        "vpmaddwd %[ones], %[s], %[s]\n\t"
        "vpaddd %[s], %[l1], %[l1]"
        : [h0] "+x"(h0), [l0] "+x"(l0), [h1] "+x"(h1), [l1] "+x"(l1), [t1] "=&x"(t1),
          [t2] "=&x"(t2), [s] "=&x"(s), [u] "=&x"(u)
        : [e0] "x"(c0.even), [o0] "x"(c0.odd), [e1] "x"(c1.even), [o1] "x"(c1.odd), [x] "r"(x),
          [ones] "m"(*reinterpret_cast<const __m256i*>(kOnes16)),
          "m"(*reinterpret_cast<const int32_t(*)[4]>(x)));
  }
}
#endif

// Which codes' 2-panel tiles take `add_word_pair`: all but levels with AVX-VNNI; without it,
// those that run on the integer tiles there (4-bit and split codes).
template <Kind K>
constexpr bool kPairInAsm =
#ifdef __AVXVNNI__
    K != Kind::kLevels;
#else
    K == Kind::kNibbles || K == Kind::kSplit;
#endif

// Nibble word n of a pair of groups of a `three_bit` weight, from the pair's words of one
// panel (`pair`; `int_tile2` makes the same words in 512 bits).
ASERVE_INLINE __m256i three_bit_word(const uint32_t* pair, int64_t low_words, int64_t n) {
  const Words8 word = nibble_word(pair + n / 2 * kLanes, pair + (2 * low_words + n / 4) * kLanes,
                                  static_cast<int>(2 * (n % 2)), static_cast<int>(n % 4));
  return reinterpret_cast<const __m256i&>(word);
}

// R rows against panels [first_panel, first_panel + P), activations as integers. `kThree`:
// a `three_bit` weight's codes, each nibble word made in registers (`three_bit_word`).
template <int R, int P, Kind K, bool kThree = false>
void int_tile(const Weight& w, const Rows& a, int64_t first_row, int64_t first_panel,
              const CodeBytes8* expanded = nullptr) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const int64_t words = w.words_per_group(), code_words = w.code_words(), stride = w.panel_words();
  const int64_t low_words = w.group / 16;  // kThree: a group's low words
  const int bias = code_bias<K>(w);
  const __m256i levels = tile_levels<K>(w);
  const int64_t row_words = a.cols / 2;
  __m256 total[R][P];
  set_zero(total);
  NextPanels next(w, first_panel + P, P, asks_ahead<R>(first_row % kRowBlock == 0));
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    __m256i hi[R][P], lo[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) hi[r][p] = lo[r][p] = _mm256_setzero_si256();
    for (int64_t v = 0; v < code_words; ++v) {
      const int64_t at = (g * w.group + v * per_word) / 2;  // the row's first word for v
      TileCodes<K> codes[P];
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const uint32_t* panel = w.words + (first_panel + p) * stride;
        if constexpr (kThree) {
          codes[p] = nibble_codes<K>(
              three_bit_word(panel + g / 2 * 3 * low_words * kLanes, low_words, g % 2 * code_words + v),
              levels);
        } else if constexpr (kPairs<K>) {
          codes[p] = word_codes<K>(panel + g * words * kLanes, code_words, v, levels);
        } else {
          codes[p] = expanded != nullptr
                         ? expanded[(p * w.groups + g) * code_words + v]
                         : word_codes<K>(panel + g * words * kLanes, code_words, v, levels);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* x = a.xq + (first_row + r) * row_words + at;
        if constexpr (P == 2 && kPairInAsm<K>) {
          add_word_pair<K>(hi[r][0], lo[r][0], hi[r][1], lo[r][1], codes[0], codes[1], x);
        } else {
#pragma GCC unroll 8
          for (int p = 0; p < P; ++p) {
            if constexpr (kPairs<K>) add_word<K>(hi[r][p], codes[p], x);
            else add_word<K>(hi[r][p], lo[r][p], codes[p], x);
          }
        }
      }
    }
    __m256 part[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const auto [sum_shift, scale] = group_shift_and_scale(a, first_row + r, g, w.group, bias);
      const __m256i shift = _mm256_set1_epi32(sum_shift);
      const __m256 xs = _mm256_set1_ps(scale);
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const __m256i sums =
            kPairs<K> ? hi[r][p]
                      : _mm256_add_epi32(_mm256_slli_epi32(group_sums<K>(hi[r][p]), 8),
                                         group_sums<K>(lo[r][p]));
        const __m256i exact = _mm256_sub_epi32(sums, shift);
        part[r][p] = _mm256_mul_ps(_mm256_cvtepi32_ps(exact), xs);
      }
    }
    close_panels(w, a, first_row, first_panel, g, part, total);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p)
      _mm256_storeu_ps(a.y + (first_row + r) * a.out + (first_panel + p) * kLanes, total[r][p]);
}

#endif
#endif
#endif

#ifdef ASERVE_NEON
// `IntActivations` on ARM CPUs with the dot-product instructions (Armv8.2's DotProd: Apple's
// M cores, Graviton 2 and newer, Cortex-A76 and newer, e.g. a Raspberry Pi 5). `sdot` adds
// four products of signed code bytes and signed activation bytes to each 32-bit lane, 16
// products an instruction where the portable tiles' float FMAs make 4, after widening each
// code to a float. A panel's 8 lanes take two 128-bit registers (lanes 0-3, 4-7). Codes are
// multiplied as signed bytes, so 8-bit codes and levels need no bias; otherwise the same
// integers as the x86 tiles and per output the same float operations as `int_tile` there: the
// same bits as the x86 builds (checked under QEMU, scripts/arm-qemu-tests.sh; not timed on an
// ARM CPU).

// Inputs [0, n) of x (n = 16 or 32; the rest read as zero) into one block: the x86 tiles'
// scale, integers (rounded to nearest even) and word layout.
inline void quantize_block(const float* x, int n, bool bytes, int32_t* words, float* scale,
                           int32_t* sums) {
  float32x4_t values[8], largest4 = vdupq_n_f32(0.0f);
  for (int i = 0; i < 8; ++i) {
    values[i] = 4 * i < n ? vld1q_f32(x + 4 * i) : vdupq_n_f32(0.0f);
    largest4 = vmaxq_f32(largest4, vabsq_f32(values[i]));
  }
  const float largest = vmaxvq_f32(largest4);
  const float32x4_t inverse = vdupq_n_f32(largest > 0.0f ? kIntLimit / largest : 0.0f);
  *scale = largest / kIntLimit;
  const uint8x16_t even_odd = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
  for (int half = 0; half < n / 16; ++half) {
    int16x8_t hi16[2], lo16[2];
    int32x4_t sum = vdupq_n_s32(0);
    for (int j = 0; j < 2; ++j) {
      int16x4_t his[2], los[2];
      for (int k = 0; k < 2; ++k) {
        const int32x4_t v = vcvtnq_s32_f32(vmulq_f32(values[4 * half + 2 * j + k], inverse));
        const int32x4_t lo = vshrq_n_s32(vshlq_n_s32(v, 24), 24);
        sum = vaddq_s32(sum, v);
        los[k] = vmovn_s32(lo);
        his[k] = vmovn_s32(vshrq_n_s32(vsubq_s32(v, lo), 8));
      }
      hi16[j] = vcombine_s16(his[0], his[1]);
      lo16[j] = vcombine_s16(los[0], los[1]);
    }
    sums[half] = vaddvq_s32(sum);
    int8x16_t hi = vcombine_s8(vmovn_s16(hi16[0]), vmovn_s16(hi16[1]));
    int8x16_t lo = vcombine_s8(vmovn_s16(lo16[0]), vmovn_s16(lo16[1]));
    if (!bytes) {  // a word's even inputs, then its odd ones
      hi = vqtbl1q_s8(hi, even_odd);
      lo = vqtbl1q_s8(lo, even_odd);
    }
    const int32x4_t hi_words = vreinterpretq_s32_s8(hi), lo_words = vreinterpretq_s32_s8(lo);
    vst1q_s32(words + 8 * half, vzip1q_s32(hi_words, lo_words));
    vst1q_s32(words + 8 * half + 4, vzip2q_s32(hi_words, lo_words));
  }
}

// A panel's code word as signed code bytes, lanes 0-3 and 4-7: the even inputs' and the odd
// inputs' (8-bit codes: the word's four inputs in `even`).
struct CodeBytes8 {
  int8x16_t even[2], odd[2];
};

// The 16 levels as signed bytes (they are kept as level + 128), loaded once per tile.
inline int8x16_t levels_of(const Weight& w) {
  if (w.levels == nullptr) return vdupq_n_s8(0);
  return vreinterpretq_s8_u8(veorq_u8(vld1q_u8(w.levels), vdupq_n_u8(0x80)));
}

// One register of a code word (4 lanes) as code bytes; split codes take bits 4 and 5 from
// `high`, the lanes' high-bit words, input i of the word at bits 2i, 2i + 1 of half `half`.
template <Kind K>
ASERVE_INLINE void code_bytes(uint8x16_t word, uint8x16_t high, int half, int8x16_t levels,
                              int8x16_t& even, int8x16_t& odd) {
  if (K == Kind::kBytes) {
    even = odd = vreinterpretq_s8_u8(word);
    return;
  }
  const uint8x16_t low = vandq_u8(word, vdupq_n_u8(15)), upper = vshrq_n_u8(word, 4);
  if (K == Kind::kLevels) {
    even = vqtbl1q_s8(levels, low);
    odd = vqtbl1q_s8(levels, upper);
    return;
  }
  if (K != Kind::kSplit) {
    even = vreinterpretq_s8_u8(low);
    odd = vreinterpretq_s8_u8(upper);
    return;
  }
  // Nibble j of the half's 16 bits to byte j (bytes 0, 0, 1, 1 of the half side by side, the
  // odd ones shifted right by 4): its low two bits are input 2j's, its high two input 2j + 1's.
  const uint8x16_t first = {0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13};
  const uint8x16_t second = {2, 2, 3, 3, 6, 6, 7, 7, 10, 10, 11, 11, 14, 14, 15, 15};
  const int8x16_t shifts = {0, -4, 0, -4, 0, -4, 0, -4, 0, -4, 0, -4, 0, -4, 0, -4};
  const uint8x16_t nibble = vandq_u8(
      vshlq_u8(vqtbl1q_u8(high, half == 0 ? first : second), shifts), vdupq_n_u8(15));
  even = vreinterpretq_s8_u8(vsliq_n_u8(low, vandq_u8(nibble, vdupq_n_u8(3)), 4));
  odd = vreinterpretq_s8_u8(vsliq_n_u8(upper, vshrq_n_u8(nibble, 2), 4));
}

// Code word v of a panel's group (`group_words`, its first word; `code_words` a group's).
template <Kind K>
ASERVE_INLINE CodeBytes8 word_codes(const uint32_t* group_words, int64_t code_words, int64_t v,
                                     int8x16_t levels) {
  const auto load = [&](int64_t at, int h) {
    return vld1q_u8(reinterpret_cast<const uint8_t*>(group_words + at * kLanes + 4 * h));
  };
  CodeBytes8 codes;
  for (int h = 0; h < 2; ++h) {
    const uint8x16_t high = K == Kind::kSplit ? load(code_words + v / 2, h) : vdupq_n_u8(0);
    code_bytes<K>(load(v, h), high, static_cast<int>(v % 2), levels, codes.even[h], codes.odd[h]);
  }
  return codes;
}

// A group's scales or offsets of a panel, lanes 0-3 and 4-7, as `Weight::value` gives each.
struct Lanes8 {
  float32x4_t half[2];
};

ASERVE_INLINE Lanes8 lanes8(const Weight& w, const void* values, int which,
                            const Weight::Spot& s) {
  const int64_t i = s.at;
  switch (w.scale_kind) {
    case ScaleKind::kFloat: {
      const float* f = static_cast<const float*>(values) + i;
      return {{vld1q_f32(f), vld1q_f32(f + 4)}};
    }
    case ScaleKind::kHalf: {
      const float16x8_t h = vreinterpretq_f16_u16(
          vld1q_u16(reinterpret_cast<const uint16_t*>(static_cast<const c10::Half*>(values) + i)));
      return {{vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h)}};
    }
    default: break;
  }
  const int16x8_t steps = vmovl_s8(vld1_s8(static_cast<const int8_t*>(values) + i));
  const float16x8_t base = vreinterpretq_f16_u16(
      vld1q_u16(reinterpret_cast<const uint16_t*>(s.base + which * kLanes)));
  return {{vmulq_f32(vcvtq_f32_s32(vmovl_s16(vget_low_s16(steps))), vcvt_f32_f16(vget_low_f16(base))),
           vmulq_f32(vcvtq_f32_s32(vmovl_high_s16(steps)), vcvt_high_f32_f16(base))}};
}

// R rows against panels [first_panel, first_panel + P): the 256-bit `int_tile`'s integers and
// float operations, in pairs of 128-bit registers (3-bit codes come widened: `kThree` unused).
template <int R, int P, Kind K, bool kThree = false>
void int_tile(const Weight& w, const Rows& a, int64_t first_row, int64_t first_panel,
              const CodeBytes8* expanded = nullptr) {
  static_assert(!kThree, "the NEON tiles take 3-bit codes widened into a buffer");
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const int64_t words = w.words_per_group(), code_words = w.code_words(), stride = w.panel_words();
  const int bias = code_bias<K>(w);
  const int8x16_t levels = levels_of(w);
  const int64_t row_words = a.cols / 2;
  float32x4_t total[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) total[r][p][0] = total[r][p][1] = vdupq_n_f32(0.0f);
  NextPanels next(w, first_panel + P, P, asks_ahead<R>(first_row % kRowBlock == 0));
  for (int64_t g = 0; g < w.groups; ++g) {
    next.ask(g);
    int32x4_t hi[R][P][2], lo[R][P][2];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h) hi[r][p][h] = lo[r][p][h] = vdupq_n_s32(0);
    for (int64_t v = 0; v < code_words; ++v) {
      const int64_t at = (g * w.group + v * per_word) / 2;  // the row's first word for v
      CodeBytes8 codes[P];
      for (int p = 0; p < P; ++p) {
        const uint32_t* group_words = w.words + (first_panel + p) * stride + g * words * kLanes;
        codes[p] = expanded != nullptr ? expanded[(p * w.groups + g) * code_words + v]
                                       : word_codes<K>(group_words, code_words, v, levels);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = reinterpret_cast<const int8_t*>(a.xq + (first_row + r) * row_words + at);
        if constexpr (K == Kind::kBytes) {  // hi and lo bytes of the word's four inputs
          const int8x8_t xv = vld1_s8(x);
          for (int p = 0; p < P; ++p)
            for (int h = 0; h < 2; ++h) {
              hi[r][p][h] = vdotq_lane_s32(hi[r][p][h], codes[p].even[h], xv, 0);
              lo[r][p][h] = vdotq_lane_s32(lo[r][p][h], codes[p].even[h], xv, 1);
            }
        } else {  // hi and lo bytes of the even inputs, then of the odd ones
          const int8x16_t xv = vld1q_s8(x);
          for (int p = 0; p < P; ++p)
            for (int h = 0; h < 2; ++h) {
              hi[r][p][h] = vdotq_laneq_s32(hi[r][p][h], codes[p].even[h], xv, 0);
              lo[r][p][h] = vdotq_laneq_s32(lo[r][p][h], codes[p].even[h], xv, 1);
              hi[r][p][h] = vdotq_laneq_s32(hi[r][p][h], codes[p].odd[h], xv, 2);
              lo[r][p][h] = vdotq_laneq_s32(lo[r][p][h], codes[p].odd[h], xv, 3);
            }
        }
      }
    }
    float32x4_t part[R][P][2];
    for (int r = 0; r < R; ++r) {
      const auto [sum_shift, scale] = group_shift_and_scale(a, first_row + r, g, w.group, bias);
      const int32x4_t shift = vdupq_n_s32(sum_shift);
      const float32x4_t xs = vdupq_n_f32(scale);
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h) {
          const int32x4_t exact =
              vsubq_s32(vaddq_s32(vshlq_n_s32(hi[r][p][h], 8), lo[r][p][h]), shift);
          part[r][p][h] = vmulq_f32(vcvtq_f32_s32(exact), xs);
        }
    }
    Weight::Spot s = w.spot(first_panel, g);
    for (int p = 0; p < P; ++p) {  // as `close_panels`: total = fma(scale, part, total), ...
      if (p > 0) s = w.next_spot(s, first_panel + p - 1, g);
      const Lanes8 scale = lanes8(w, w.scales, 0, s);
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h)
          total[r][p][h] = vfmaq_f32(total[r][p][h], scale.half[h], part[r][p][h]);
      if (w.offsets == nullptr) continue;
      const Lanes8 offset = lanes8(w, w.offsets, 1, s);
      for (int r = 0; r < R; ++r) {  // ... then fma(offset, xsum, total)
        const float32x4_t xsum = vdupq_n_f32(a.xsum[(first_row + r) * a.groups + g]);
        for (int h = 0; h < 2; ++h)
          total[r][p][h] = vfmaq_f32(total[r][p][h], offset.half[h], xsum);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int h = 0; h < 2; ++h)
        vst1q_f32(a.y + (first_row + r) * a.out + (first_panel + p) * kLanes + 4 * h,
                  total[r][p][h]);
}
#endif

#if defined(ASERVE_INT256) || defined(ASERVE_NEON)
// The 256-bit and the NEON integer tiles (`int_tile`, `word_codes`: one panel's 8 lanes in a
// 256-bit register or two 128-bit ones) take rows alike.

// Panels [first, first + count) as their code bytes in `out`, [panel][group][word]: split
// codes' bytes made once for all tiles of a unit's rows (`int_rows`).
inline void expand_split(const Weight& w, int64_t first, int64_t count, CodeBytes8* out) {
  const int64_t words = w.words_per_group(), code_words = w.code_words();
  const auto levels = levels_of(w);  // unread by split codes' bytes
  for (int64_t p = first; p < first + count; ++p)
    for (int64_t g = 0; g < w.groups; ++g)
      for (int64_t v = 0; v < code_words; ++v)
        *out++ = word_codes<Kind::kSplit>(w.words + p * w.panel_words() + g * words * kLanes,
                                          code_words, v, levels);
}

template <int R, int P, Kind K, bool kThree>
void int_panels(const Weight& w, const Rows& a, int64_t row, int64_t first_panel,
                int64_t last_panel) {
  int64_t p = first_panel;
  for (; p + P <= last_panel; p += P) int_tile<R, P, K, kThree>(w, a, row, p);
  for (; p < last_panel; ++p) int_tile<R, 1, K, kThree>(w, a, row, p);
}

// Tiles of 2 rows x 2 panels, a last row 1 x 2 (AVX2 build on a Zen 5 VM, 2 threads, 5,120 x
// 2,048, GMAC/s at 16 / 128 rows: Q4_K 103 / 107, Q8_0 116 / 122; 2 x 1 tiles 82 / 87 and 81 /
// 85, 3 x 1 94 / 101 and 96 / 105, 3 x 2 as 2 x 2; the float tiles 77 / 96 and 86 / 111).
// Split codes gain at one row (Q6_K 19 -> 30 GMAC/s) and lose from 16 (128 rows 91 -> 74, with
// a pair of panels' code bytes made once for all rows, `expand_split`; 67 with each tile making
// them), but a step of a Q4_K_M file still gains (Llama-3.2-1B's shape: decode 29.2 -> 25.2 ms
// a step, a 128-token prefill 1.18 -> 1.25 s). Not timed on an ARM CPU.
// Levels and 8-bit codes without AVX-VNNI (`kPairs`) take tiles of 4 rows (then 3, 2, 1), one
// sum a row and panel: on an AVX2-only AMD EPYC VM, one thread, 4,096 x 2,048, GMAC/s at 1 / 4
// / 16 / 127 rows, IQ4_XS 12.1 / 24.3 / 25.2 / 32.7 against the float tiles' 6.5 / 13.6 / 18.3
// / 30.0, Q8_0 19.9 / 37.1 / 40.8 / 42.1 against 8.7 / 18.6 / 22.0 / 29.1. With 2-row tiles
// they had lost to the float tiles from 16 rows, and with codes made once for all tiles (as
// split codes are) at 4.
template <Kind K, bool kThree = false>
void int_rows(const Weight& w, const Rows& a, int64_t first, int64_t last, int64_t first_panel,
              int64_t last_panel) {
  if (K == Kind::kSplit && last - first > 2) {
    // a pair of panels' split codes made bytes once for every tile of the rows, not by each:
    // a word's high bits take ~11 instructions, which 2 rows did not pay for
    static thread_local std::vector<CodeBytes8> buffer;
    buffer.resize(2 * w.groups * w.code_words());
    for (int64_t p = first_panel; p < last_panel; p += 2) {
      const int64_t count = std::min<int64_t>(2, last_panel - p);
      expand_split(w, p, count, buffer.data());
      int64_t row = first;
      for (; row + 2 <= last; row += 2) {
        if (count == 2) int_tile<2, 2, K>(w, a, row, p, buffer.data());
        else int_tile<2, 1, K>(w, a, row, p, buffer.data());
      }
      if (row < last) {
        if (count == 2) int_tile<1, 2, K>(w, a, row, p, buffer.data());
        else int_tile<1, 1, K>(w, a, row, p, buffer.data());
      }
    }
    return;
  }
  int64_t row = first;
  if constexpr (kPairs<K>) {
    for (; row + 4 <= last; row += 4) int_panels<4, 2, K, kThree>(w, a, row, first_panel, last_panel);
    if (row + 3 <= last) {
      int_panels<3, 2, K, kThree>(w, a, row, first_panel, last_panel);
      row += 3;
    }
  }
  for (; row + 2 <= last; row += 2) int_panels<2, 2, K, kThree>(w, a, row, first_panel, last_panel);
  if (row < last) int_panels<1, 2, K, kThree>(w, a, row, first_panel, last_panel);
}
#endif

#ifdef ASERVE_INT
// Rows [first, last) of `a` (picked or not) into xq [rows, cols / 2], xscale [rows, blocks],
// xisum [rows, cols / 16], laid out for the tiles of codes of kind `kind`; cols is a multiple
// of 16.
void quantize_rows(const Rows& a, Kind kind, int64_t first, int64_t last, int32_t* xq,
                   float* xscale, int32_t* xisum) {
  const int64_t blocks = a.blocks();
  const bool bytes = kind == Kind::kBytes;
#ifdef ASERVE_INT256
  // levels and 8-bit codes are `kPairs` alike
  const bool pairs = kPairs<Kind::kLevels> && (kind == Kind::kLevels || bytes);
#endif
  for (int64_t m = first; m < last; ++m) {
    const float* row = a.row(m);
    for (int64_t b = 0; b < blocks; ++b) {
      const int n = static_cast<int>(std::min<int64_t>(32, a.cols - 32 * b));
      int32_t* words = xq + m * a.cols / 2 + 16 * b;
      float* scale = xscale + m * blocks + b;
      int32_t* sums = xisum + m * a.cols / 16 + 2 * b;
#ifdef ASERVE_INT256
      quantize_block(row + 32 * b, n, bytes, pairs, words, scale, sums);
#else
      quantize_block(row + 32 * b, n, bytes, words, scale, sums);
#endif
    }
  }
}
#endif

#ifdef ASERVE_AVX2
template <Kind K>
void rows_against_panels_of(const Weight& w, const Rows& a, int64_t first, int64_t last,
                            int64_t first_panel, int64_t last_panel, std::vector<float>& buffer) {
#ifdef ASERVE_VNNI
  if constexpr (K == Kind::kNibbles || K == Kind::kLevels) {
    if (a.xq != nullptr && w.three_bit)
      return few_rows<K, true, true>(w, a, first, last, first_panel, last_panel);
  }
#ifdef ASERVE_AMX
  if constexpr (K != Kind::kBytes) {
    if (a.xt != nullptr && last - first >= 16)
      return amx_rows<K>(w, a, first, last, first_panel, last_panel);
  }
#endif
  if (a.xq != nullptr) return few_rows<K, true>(w, a, first, last, first_panel, last_panel);
#elif defined(ASERVE_INT256)
  if constexpr (K == Kind::kNibbles || K == Kind::kLevels) {
    if (a.xq != nullptr && w.three_bit)
      return int_rows<K, true>(w, a, first, last, first_panel, last_panel);
  }
  if (a.xq != nullptr) return int_rows<K>(w, a, first, last, first_panel, last_panel);
#endif
  if (last - first >= kManyRows) {
    buffer.resize(2 * w.cols * kLanes);
    many_rows<K>(w, a, first, last, first_panel, last_panel, buffer.data());
  } else {
    few_rows<K>(w, a, first, last, first_panel, last_panel);
  }
}

void rows_against_panels(const Weight& w, const Rows& a, int64_t first, int64_t last,
                         int64_t first_panel, int64_t last_panel, std::vector<float>& buffer) {
  switch (kind_of(w)) {
    case Kind::kNibbles:
      return rows_against_panels_of<Kind::kNibbles>(w, a, first, last, first_panel, last_panel, buffer);
    case Kind::kBytes:
      return rows_against_panels_of<Kind::kBytes>(w, a, first, last, first_panel, last_panel, buffer);
    case Kind::kLevels:
      return rows_against_panels_of<Kind::kLevels>(w, a, first, last, first_panel, last_panel, buffer);
    case Kind::kSplit:
      return rows_against_panels_of<Kind::kSplit>(w, a, first, last, first_panel, last_panel, buffer);
  }
}
#endif

// The code of input i of one lane's word, as a float (lookups of rows, and CPUs without
// AVX2); `high`, split codes' high bits of the word's inputs (`high_bits`).
inline float code_of(const Weight& w, uint32_t word, int i, uint32_t high = 0) {
  if (!w.four_bit && !w.split) return static_cast<float>(static_cast<int8_t>((word >> (8 * i)) & 255));
  const uint32_t code = (word >> (4 * i)) & 15;
  const float level =
      w.levels != nullptr ? static_cast<float>(w.levels[code]) - 128.0f : static_cast<float>(code);
  return w.split ? level + static_cast<float>(16 * ((high >> (2 * i)) & 3)) : level;
}

#ifndef ASERVE_AVX2
// The same operations without x86's vector instructions (ARM, older x86): R rows against one
// panel, its 8 lanes kept in arrays whose loops the compiler vectorises (NEON, SSE), a word's
// codes made floats once for all R rows.
template <int R, Kind K>
void portable_tile(const Weight& w, const Rows& a, int64_t first_row, int64_t panel) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const int64_t words = w.words_per_group(), code_words = w.code_words();
  const float* x[R];
  for (int r = 0; r < R; ++r) x[r] = a.row(first_row + r);
  float total[R][kLanes] = {};
  for (int64_t g = 0; g < w.groups; ++g) {
    float part[R][kLanes] = {};
    for (int64_t v = 0; v < code_words; ++v) {
      const uint32_t* group_words = w.words + panel * w.panel_words() + g * words * kLanes;
      const uint32_t* word = group_words + v * kLanes;
      const int64_t k0 = g * w.group + v * per_word;
      float codes[per_word][kLanes];
      for (int i = 0; i < per_word; ++i) {
        for (int lane = 0; lane < kLanes; ++lane) {
          if (K == Kind::kSplit) {
            codes[i][lane] = code_of(w, word[lane], i, high_bits(w, group_words, v, lane));
          } else if (K == Kind::kBytes) {
            codes[i][lane] = static_cast<float>(static_cast<int8_t>((word[lane] >> (8 * i)) & 255));
          } else {
            const uint32_t code = (word[lane] >> (4 * i)) & 15;
            codes[i][lane] = K == Kind::kLevels ? static_cast<float>(w.levels[code]) - 128.0f
                                                : static_cast<float>(code);
          }
        }
      }
      for (int i = 0; i < per_word; ++i)
        for (int r = 0; r < R; ++r) {
          const float xk = x[r][k0 + i];
          for (int lane = 0; lane < kLanes; ++lane)
            part[r][lane] = std::fma(codes[i][lane], xk, part[r][lane]);
        }
    }
    for (int r = 0; r < R; ++r)
      for (int lane = 0; lane < kLanes; ++lane) {
        total[r][lane] = std::fma(w.scale(panel, g, lane), part[r][lane], total[r][lane]);
        if (w.offsets != nullptr)
          total[r][lane] = std::fma(w.offset(panel, g, lane),
                                    a.xsum[(first_row + r) * a.groups + g], total[r][lane]);
      }
  }
  for (int r = 0; r < R; ++r)
    std::copy_n(total[r], kLanes, a.y + (first_row + r) * a.out + panel * kLanes);
}

template <Kind K>
void portable_rows(const Weight& w, const Rows& a, int64_t first, int64_t last,
                   int64_t first_panel, int64_t last_panel) {
#ifdef ASERVE_NEON
  if (a.xq != nullptr) return int_rows<K>(w, a, first, last, first_panel, last_panel);
#endif
  for (int64_t p = first_panel; p < last_panel; ++p) {
    int64_t row = first;
    for (; row + 4 <= last; row += 4) portable_tile<4, K>(w, a, row, p);
    for (; row < last; ++row) portable_tile<1, K>(w, a, row, p);
  }
}

void rows_against_panels(const Weight& w, const Rows& a, int64_t first, int64_t last,
                         int64_t first_panel, int64_t last_panel, std::vector<float>&) {
  switch (kind_of(w)) {
    case Kind::kNibbles: return portable_rows<Kind::kNibbles>(w, a, first, last, first_panel, last_panel);
    case Kind::kBytes: return portable_rows<Kind::kBytes>(w, a, first, last, first_panel, last_panel);
    case Kind::kLevels: return portable_rows<Kind::kLevels>(w, a, first, last, first_panel, last_panel);
    case Kind::kSplit: return portable_rows<Kind::kSplit>(w, a, first, last, first_panel, last_panel);
  }
}
#endif

// The weight in `words`, `scales` and `offsets`; or, where scales have a leading dimension
// of E experts ([E, panels, groups, 8], words [E, n]), expert 0 of such a stack, all of one
// format and shape (`expert_of` gives the others).
Weight weight_of(const at::Tensor& words, const at::Tensor& scales, const at::Tensor& offsets,
                 const at::Tensor& bases, int64_t group, int64_t code_bits,
                 const std::optional<at::Tensor>& levels) {
  TORCH_CHECK(words.scalar_type() == at::kInt && words.is_contiguous(), "words: int32");
  TORCH_CHECK(code_bits == 2 || code_bits == 3 || code_bits == 4 || code_bits == 6 || code_bits == 8,
              "codes are kept in 2 (entries of a book), 3 (two bits and one), 4, 6 (a nibble and ",
              "two bits) or 8 bits, not ", code_bits);
  const bool four_bit = code_bits <= 4, split = code_bits == 6;
  const auto type = scales.scalar_type();
  const ScaleKind kind = type == at::kHalf   ? ScaleKind::kHalf
                         : type == at::kChar ? ScaleKind::kSteps
                                             : ScaleKind::kFloat;
  TORCH_CHECK((scales.dim() == 3 || scales.dim() == 4) && scales.size(-1) == kLanes &&
                  (kind != ScaleKind::kFloat || type == at::kFloat) && scales.is_contiguous(),
              "scales: float32, float16 or int8 steps [panels, groups, 8] (or [experts, panels, "
              "groups, 8])");
  const bool has_offsets = offsets.numel() > 0;
  TORCH_CHECK(!has_offsets || (offsets.sizes() == scales.sizes() &&
                               offsets.scalar_type() == type && offsets.is_contiguous()),
              "offsets: as scales, or empty where all are zero");
  TORCH_CHECK(group == 16 || group == 32, "groups are 16 or 32 inputs, got ", group);
  if (levels.has_value()) {
    TORCH_CHECK((four_bit || split) && levels->scalar_type() == at::kByte &&
                    levels->is_contiguous() &&
                    (code_bits == 2 ? levels->numel() >= 24 && levels->numel() % 4 == 0
                                    : levels->numel() == 16),
                "levels: 16 bytes (level + 128), for 4-bit codes or split codes' low bits; for "
                "entries of a book, then the book's words");
  }
  TORCH_CHECK(code_bits != 2 || levels.has_value(), "entries of a book need the book");
  const int64_t count = scales.dim() == 4 ? scales.size(0) : 1;
  const int64_t panels = scales.size(-3), groups = scales.size(-2);
  int64_t block_shift = 0;
  if (kind == ScaleKind::kSteps) {
    TORCH_CHECK(bases.scalar_type() == at::kHalf && bases.is_contiguous() &&
                    bases.dim() == scales.dim() + 1 && bases.size(-1) == kLanes &&
                    bases.size(-2) == 2 && bases.size(-4) == panels &&
                    (count == 1 || bases.size(0) == count),
                "bases: float16 [panels, blocks, 2, 8] (or [experts, ...]) for int8 steps");
    const int64_t blocks = bases.size(-3);
    TORCH_CHECK(blocks > 0 && groups % blocks == 0, "groups do not split into the bases' blocks");
    while ((blocks << block_shift) < groups) ++block_shift;
    TORCH_CHECK((blocks << block_shift) == groups, "a power of two of groups a block");
  }
  Weight w{reinterpret_cast<const uint32_t*>(words.data_ptr<int32_t>()),
           scales.data_ptr(),
           has_offsets ? offsets.data_ptr() : nullptr,
           kind,
           kind == ScaleKind::kSteps ? bases.data_ptr<at::Half>() : nullptr,
           block_shift,
           panels,
           groups,
           group,
           groups * group,
           panels,
           0,
           four_bit,
           split,
           levels.has_value() ? levels->data_ptr<uint8_t>() : nullptr,
           code_bits == 3};
  if (code_bits == 2) {
    const uint32_t* header = reinterpret_cast<const uint32_t*>(w.levels + 16);
    TORCH_CHECK(header[0] == 16 || (header[0] == 24 && levels->numel() == 20 + 4 * (65536 + 256)),
                "a book's entries are 16 bits, or 24 with 65,536 patterns and 256 flips");
    w.entry_bytes = header[0] / 8;
    w.book = header + 1;
  }
  TORCH_CHECK(!w.three_bit || groups % 2 == 0, "3-bit codes come in pairs of groups");
  TORCH_CHECK(words.numel() == count * panels * w.panel_words(), "words do not match the scales");
  return w;
}

// The panels of w from `first` on, as a weight of its own (a slice of panels): words moved
// on by `first` panels, and its scales', offsets' and bases' panels found `first` further on
// in their blocks.
Weight panels_from(const Weight& w, int64_t first) {
  Weight v = w;
  v.words += first * w.panel_words();
  v.panel_shift += first;
  v.panels -= first;
  return v;
}

// One nibble word of each lane (`widen_three`).
ASERVE_INLINE void widen_word(const uint32_t* low, const uint32_t* high, int low_shift,
                              int high_shift, uint32_t* out) {
  const Words8 word = nibble_word(low, high, low_shift, high_shift);
  std::memcpy(out, &word, sizeof word);
}

// Panels [first, first + count) of w as the 4-bit weight whose words `widen_three` or
// `widen_book` made into `out`.
Weight nibbles_of(const Weight& w, int64_t first, int64_t count, const std::vector<uint32_t>& out) {
  Weight v = panels_from(w, first);
  v.words = out.data();
  v.panels = count;
  v.three_bit = false;
  v.book = nullptr;
  return v;
}

// Panels [first, first + count) of a `three_bit` weight as the nibble words of a 4-bit one
// into `out` (count * groups * group / 8 * 8 words), and that weight, whose panel 0 is w's
// `first`: its products are w's, since both hold the same codes. A pair of groups' words a
// lane are its low bits (inputs k and k + 8 of each 16 in nibble k, bits 4k and 4k + 2),
// then its high bits (input 8j + k of the pair at bit 4k + j): each nibble word is two
// shifts, two masks and an or of them, eight lanes at a time. Where this build's tiles take
// the codes in registers (`three_bit_in_registers`) they make the same words themselves.
Weight widen_three(const Weight& w, int64_t first, int64_t count, std::vector<uint32_t>& out) {
  const int64_t low_words = w.group / 16, unit_words = 3 * low_words;
  const int64_t nibble_words = w.group / 4;  // a pair of groups' nibble words, a lane
  out.resize(count * w.groups / 2 * nibble_words * kLanes);
  uint32_t* at = out.data();
  for (int64_t p = first; p < first + count; ++p)
    for (int64_t u = 0; u < w.groups / 2; ++u) {
      const uint32_t* unit = w.words + p * w.panel_words() + u * unit_words * kLanes;
      // nibble word n of the pair: low word n / 2 shifted by 2 (n % 2), high word n / 4
      // shifted by n % 4
      for (int64_t n = 0; n < nibble_words; n += 4, at += 4 * kLanes) {
        const uint32_t* low = unit + n / 2 * kLanes;
        const uint32_t* high = unit + (2 * low_words + n / 4) * kLanes;
        widen_word(low, high, 0, 0, at);
        widen_word(low, high, 2, 1, at + kLanes);
        widen_word(low + kLanes, high, 0, 2, at + 2 * kLanes);
        widen_word(low + kLanes, high, 2, 3, at + 3 * kLanes);
      }
    }
  return nibbles_of(w, first, count, out);
}

// Panels [first, first + count) of a `book` weight as the nibble words of a 4-bit one into
// `out`, and that weight (as `widen_three`'s): a 16-bit entry is the book's word, a 24-bit
// one its low 16 bits' word flipped by its signs, and the entries lie in the order of the
// words they stand for. A load a word from a book of up to 256 KiB: a 1B IQ2_XXS decode
// step takes ~1.4x the time of three-bit codes widened in registers (AVX-512 VNNI; its
// gathers were no faster than this loop) for 2.5 bits a weight instead of 3.5, IQ3_XXS ~1.8x
// that of 4-bit codes for 3.5 instead of 4.5. Python checks the entries against the book.
Weight widen_book(const Weight& w, int64_t first, int64_t count, std::vector<uint32_t>& out) {
  const int64_t words = count * w.panel_words() * 4 / w.entry_bytes;
  out.resize(words);
  const void* at = w.words + first * w.panel_words();
  if (w.entry_bytes == 2) {
    const uint16_t* entries = static_cast<const uint16_t*>(at);
    for (int64_t i = 0; i < words; ++i) out[i] = w.book[entries[i]];
  } else {  // the low 16 bits' pattern, its negative inputs' codes flipped by the top 8
    const uint8_t* entries = static_cast<const uint8_t*>(at);
    const uint32_t* flips = w.book + 65536;
    auto word = [&](uint32_t e) { return w.book[e & 0xFFFF] ^ flips[(e >> 16) & 0xFF]; };
    // four bytes a load, but the last entry's three alone: its fourth lies past the weight
    for (int64_t i = 0; i + 1 < words; ++i) {
      uint32_t e;
      std::memcpy(&e, entries + 3 * i, 4);
      out[i] = word(e);
    }
    const uint8_t* last = entries + 3 * (words - 1);
    out[words - 1] = word(last[0] | last[1] << 8 | last[2] << 16);
  }
  return nibbles_of(w, first, count, out);
}

// Panels [first, first + count) of a weight that `widens` as the nibble words of a 4-bit one.
Weight widen(const Weight& w, int64_t first, int64_t count, std::vector<uint32_t>& out) {
  return w.book != nullptr ? widen_book(w, first, count, out) : widen_three(w, first, count, out);
}

// Expert e of a stack (`weight_of`), from expert 0.
Weight expert_of(const Weight& first, int64_t e) {
  Weight w = first;
  const int64_t panels = e * first.panels;  // each expert's scales in blocks of its own
  const int64_t scale_bytes = panels * first.groups * kLanes * first.scale_bytes();
  w.words += panels * first.panel_words();
  w.scales = static_cast<const char*>(first.scales) + scale_bytes;
  if (first.offsets != nullptr) w.offsets = static_cast<const char*>(first.offsets) + scale_bytes;
  if (first.bases != nullptr) w.bases += panels * first.base_values();
  return w;
}

// One product under way: rows of x (`Rows`: every row of a contiguous [rows, w.cols] matrix,
// or the `picked` rows of a wider one) against w, into y [rows, w.panels * 8] contiguous
// float32; `xsum` each row's sum over each group (for the offsets).
struct Product {
  Weight w;
  const float* x;
  const int64_t* picked;
  int64_t x_stride;
  float* y;
  int64_t rows;
  std::vector<float> xsum;
  std::vector<int32_t> xq, xisum, xt;  // `IntActivations`, where they take this product
  std::vector<float> xscale;

  Rows operands() const {
    return Rows{x,       picked,  x_stride,
                xsum.data(), y,   w.cols,
                w.groups, w.panels * kLanes,
                xq.empty() ? nullptr : xq.data(), xscale.data(), xisum.data(),
                xt.empty() ? nullptr : xt.data()};
  }
};

// Whether products of codes kept in `code_bits` (3 and 4: nibbles as multiplied, 6: split, 8)
// multiply activations as integers
// (`IntActivations`): on CPUs with AVX-512
// VNNI (split codes also need VBMI's byte gathers), and with AVX2 (AVX-VNNI, or without it
// `vpmaddubsw` for 4-bit and split codes, `vpmaddwd` for levels and 8-bit ones: `kPairs`),
// unless turned off for this process (`enable` false: tests and benchmarks compare the two).
bool int_activations_on = true;

bool int_activations(std::optional<bool> enable, int64_t code_bits) {
  if (enable.has_value()) int_activations_on = *enable;
  if (code_bits <= 3) code_bits = 4;  // multiplied as nibbles once widened
#ifdef ASERVE_INT
#if defined(ASERVE_VNNI) && !defined(__AVX512VBMI__)
  if (code_bits == 6) return false;
#endif
  return int_activations_on;
#else
  (void)code_bits;
  return false;
#endif
}

// Whether this build multiplies with integer dot-product instructions (AVX-512 VNNI, AVX-VNNI,
// ARM's `sdot`), which add four byte products to a 32-bit sum in one.
bool dot_products() {
#if defined(ASERVE_VNNI) || (defined(ASERVE_INT256) && defined(__AVXVNNI__)) || defined(ASERVE_NEON)
  return true;
#else
  return false;
#endif
}

// Whether this build's tiles widen 3-bit codes (standing for levels, or not) in registers
// as they multiply: the integer tiles with AVX-512 VNNI or AVX-VNNI (a 1B decode step 2% and
// 4% slower than with nibbles for Q3_K_M and IQ2_XXS files, 12% and 16% less memory, an
// AVX-VNNI build; prefill alike). Plain AVX2's tiles widen them too but lost 8% a step for
// 12% (Q2_K), and elsewhere `run` widens a few panels into a buffer first, which took a 1B
// Q3_K_M step ~1.4x the time of nibbles (AVX-512 build, integer activations off): there
// `NativeWeight` keeps nibbles.
bool three_bit_in_registers() {
#ifdef ASERVE_NEON
  return false;  // the NEON tiles take 3-bit codes widened into a buffer
#else
  return dot_products() && int_activations(std::nullopt, 3);
#endif
}

bool int_kind(const Weight& w) {
  return int_activations(std::nullopt, w.split ? 6 : w.four_bit ? 4 : 8);
}

Product product_at(const float* x, int64_t rows, const Weight& w, float* y,
                   const int64_t* picked = nullptr, int64_t x_stride = 0) {
  Product p{w, x, picked, x_stride ? x_stride : w.cols, y, rows,
            std::vector<float>(rows * w.groups)};
  const Rows a = p.operands();
#ifdef ASERVE_INT
  if (int_kind(w)) {
    p.xq.resize(rows * w.cols / 2);
    p.xscale.resize(rows * a.blocks());
    p.xisum.resize(rows * w.cols / 16);
    // Rows in parallel from 16 (prefill chunks); fewer on the calling thread, as waking the
    // team would cost more. The offsets' sums are of the rounded activations, so that the
    // product is the weight's with exactly those.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      quantize_rows(a, kind_of(w), begin, end, p.xq.data(), p.xscale.data(),
                    p.xisum.data());
      for (int64_t m = begin; m < end; ++m)
        for (int64_t g = 0; g < w.groups; ++g) {
          const int32_t* sums = p.xisum.data() + m * w.cols / 16 + g * w.group / 16;
          const int32_t sum = w.group == 32 ? sums[0] + sums[1] : sums[0];
          p.xsum[m * w.groups + g] =
              static_cast<float>(sum) * p.xscale[m * a.blocks() + g * w.group / 32];
        }
    });
#ifdef ASERVE_AMX
    if (rows >= 16 && kind_of(w) != Kind::kBytes && !w.widens() && amx_tiles(std::nullopt)) {
      p.xt.resize(p.xq.size());
      const int64_t words = w.cols / 2;
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m)
          tile_order(p.xq.data() + m * words, words, w.group / 2, p.xt.data() + m * words);
      });
    }
#endif
    return p;
  }
#endif
  // Each group's sum in input order, eight groups' chains of adds under way at once (one
  // chain at a time took ~1.6 us for a 1,024-input row).
  constexpr int64_t kChains = 8;
  for (int64_t m = 0; m < rows; ++m) {
    const float* row = a.row(m);
    for (int64_t g0 = 0; g0 < w.groups; g0 += kChains) {
      const int64_t count = std::min(kChains, w.groups - g0);
      float sum[kChains] = {};
      for (int64_t k = 0; k < w.group; ++k)
        for (int64_t j = 0; j < count; ++j) sum[j] += row[(g0 + j) * w.group + k];
      std::copy_n(sum, count, p.xsum.data() + m * w.groups + g0);
    }
  }
  return p;
}

// `x` against `w` into a new [rows, panels * 8] tensor, returned with its product.
std::pair<Product, at::Tensor> product_of(const at::Tensor& x, const Weight& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  TORCH_CHECK(x.size(1) == w.cols, "x has ", x.size(1), " columns, the weight ", w.cols);
  at::Tensor y = at::empty({x.size(0), w.panels * kLanes}, x.options());
  return {product_at(x.data_ptr<float>(), x.size(0), w, y.data_ptr<float>()), y};
}

// Runs of units a thread takes from `run`'s counter: a thread's share in about this many
// runs, so that one slowed down (by another process, or by serial work before the region)
// leaves its last units to the others.
constexpr int64_t kRunsAThread = 8;

// Every product's (row block, panel block) units in one parallel region, row-block-major
// within a product: a run of units mostly shares one block of x. Threads take runs of units
// from a counter as they finish their last, not equal shares up front: with equal shares a
// 2-core EPYC's second thread waited for the first ~15% of a one-row decode step (perf: the
// calling thread also quantizes the activations and runs the serial steps). A unit is found
// from its index (the products' first units are kept, not the units: `linear` runs for
// every product of a model, and a list of an LM head's units is ~800 entries). Each unit
// writes its own outputs, so the bits do not depend on which thread takes it.
void run(const std::vector<Product>& products) {
  auto panel_blocks = [](const Product& p) { return (p.w.panels + kPanelBlock - 1) / kPanelBlock; };
  std::vector<int64_t> starts{0};
  for (const Product& p : products) {
    const int64_t row_blocks = (p.rows + kRowBlock - 1) / kRowBlock;
    starts.push_back(starts.back() + row_blocks * panel_blocks(p));
  }
  const int64_t units = starts.back();
  const int64_t team = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  const int64_t run_units = std::max<int64_t>(1, units / (team * kRunsAThread));
  std::atomic<int64_t> next_run{0};
  at::parallel_for(0, team, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;
    std::vector<uint32_t> widened;
    size_t k = 0;
    int64_t end = 0;
    for (int64_t unit = 0;; ++unit) {
      if (unit == end) {  // the next run not yet taken
        unit = next_run.fetch_add(run_units, std::memory_order_relaxed);
        if (unit >= units) break;
        end = std::min(units, unit + run_units);
      }
      while (unit >= starts[k + 1]) ++k;
      const Product& p = products[k];
      const int64_t blocks = panel_blocks(p), local = unit - starts[k];
      const int64_t first = local / blocks * kRowBlock, first_panel = local % blocks * kPanelBlock;
      const int64_t last = std::min(p.rows, first + kRowBlock);
      const int64_t last_panel = std::min(p.w.panels, first_panel + kPanelBlock);
#if defined(ASERVE_VNNI) || defined(ASERVE_INT256)
      // the x86 integer tiles widen 3-bit codes themselves, each tile its own: for a few rows
      // (decode) that costs less than widening into a buffer, from more rows (a prefill
      // chunk) more
      const bool in_registers = !p.xq.empty() && last - first <= kWidenInRegistersRows;
#else
      const bool in_registers = false;
#endif
      if (!p.w.widens() || (p.w.three_bit && in_registers)) {
        rows_against_panels(p.w, p.operands(), first, last, first_panel, last_panel, buffer);
        continue;
      }
      // a few panels widened at a time, their nibbles still in cache as the tiles read them
      // (entries all the unit's panels at once: four at a time left the one-row tiles half
      // their panels, and a 1B IQ2_XXS decode step took 59 ms against 54)
      const int64_t at_once = p.w.book != nullptr ? kPanelBlock : kWidenPanels;
      for (int64_t q = first_panel; q < last_panel; q += at_once) {
        const int64_t count = std::min(at_once, last_panel - q);
        const Weight nibbles = widen(p.w, q, count, widened);
        Rows a = p.operands();
        a.y += q * kLanes;
        rows_against_panels(nibbles, a, first, last, 0, count, buffer);
      }
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales,
                  const at::Tensor& offsets, const at::Tensor& bases, int64_t group,
                  int64_t code_bits, const std::optional<at::Tensor>& levels) {
  if (aserve_float::holds(words)) return aserve_float::linear(x, words);
  auto [product, y] =
      product_of(x, weight_of(words, scales, offsets, bases, group, code_bits, levels));
  run({product});
  return y;
}

// SiLU(gate) * up of x against a fused gate|up weight (`inter` gate rows, then `inter` up
// rows): the product, then ATen's SiLU and multiply as the caller's would run them, in one
// call of the op (a decode step of the embedded model paid ~10 us a layer for the three ATen
// calls and the Python around them).
at::Tensor gated_linear(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scales,
                        const at::Tensor& offsets, const at::Tensor& bases, int64_t group,
                        int64_t code_bits, const std::optional<at::Tensor>& levels,
                        int64_t inter) {
  at::Tensor y;
  if (aserve_float::holds(words)) {
    y = aserve_float::linear(x, words);
  } else {
    auto [product, out] =
        product_of(x, weight_of(words, scales, offsets, bases, group, code_bits, levels));
    y = out;
    run({product});
  }
  TORCH_CHECK(y.size(1) >= 2 * inter, "the weight has fewer than 2 x ", inter, " rows");
  return at::silu(y.narrow(1, 0, inter)).mul_(y.narrow(1, inter, inter));
}

// xs[i] against weight i (words[i], scales[i], offsets[i], bases[i]; one format for all), in one
// parallel region: a token's chosen experts are products too small each to keep the cores
// busy in a region of their own. Every output is computed as `linear` computes it.
std::vector<at::Tensor> linear_group(at::TensorList xs, at::TensorList words,
                                     at::TensorList scales, at::TensorList offsets,
                                     at::TensorList bases, int64_t group, int64_t code_bits,
                                     const std::optional<at::Tensor>& levels) {
  TORCH_CHECK(words.size() == xs.size() && scales.size() == xs.size() &&
                  offsets.size() == xs.size() && bases.size() == xs.size(),
              "one weight for each x");
  std::vector<Product> products;
  std::vector<at::Tensor> ys;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto [product, y] =
        product_of(xs[i], weight_of(words[i], scales[i], offsets[i], bases[i], group, code_bits,
                                    levels));
    products.push_back(std::move(product));
    ys.push_back(y);
  }
  run(products);
  return ys;
}

// Each token's top_k experts and their weights as layers/moe.route chooses them: router logits
// in float32 (one fixed order of operations a logit, so a token's logits do not depend on its
// batch), softmax, the k largest in descending order (ties to the lower expert), renormalised
// over the k if asked. With a `choice_bias` (GLM-4.5's, layers/moe.route_deepseek in one group)
// the scores are the logits' sigmoids, the k largest scores plus that bias are chosen, and
// their scores, renormalised as transformers does (over their sum plus 1e-20), are multiplied
// by `scaling`.
void route(const at::Tensor& x, const at::Tensor& router, const float* bias, int64_t top_k,
           bool renormalize, const float* choice_bias, float scaling, std::vector<int64_t>& ids,
           std::vector<float>& chosen_weights) {
  TORCH_CHECK(router.dim() == 2 && router.size(1) == x.size(1) &&
                  router.scalar_type() == at::kFloat && router.is_contiguous(),
              "router: float32 [experts, hidden]");
  const int64_t tokens = x.size(0), hidden = x.size(1), experts = router.size(0);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "]");
  std::vector<float> logits(tokens * experts);
  const float* xp = x.data_ptr<float>();
  const float* rp = router.data_ptr<float>();
  constexpr int64_t kWidth = 16, kExpertsAtOnce = 4;  // four chains of FMAs under way
  at::parallel_for(0, (experts + kExpertsAtOnce - 1) / kExpertsAtOnce, 4,
                   [&](int64_t begin, int64_t end) {
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t block = begin; block < end; ++block) {
        const int64_t e0 = block * kExpertsAtOnce, count = std::min(kExpertsAtOnce, experts - e0);
        float lanes[kExpertsAtOnce][kWidth] = {};
        for (int64_t k = 0; k + kWidth <= hidden; k += kWidth)
          for (int64_t j = 0; j < count; ++j)
            for (int64_t i = 0; i < kWidth; ++i)
              lanes[j][i] = std::fma(xp[t * hidden + k + i], rp[(e0 + j) * hidden + k + i], lanes[j][i]);
        for (int64_t j = 0; j < count; ++j) {
          float total = 0;
          for (int64_t i = 0; i < kWidth; ++i) total += lanes[j][i];
          for (int64_t k = hidden / kWidth * kWidth; k < hidden; ++k)
            total = std::fma(xp[t * hidden + k], rp[(e0 + j) * hidden + k], total);
          logits[t * experts + e0 + j] = bias == nullptr ? total : total + bias[e0 + j];
        }
      }
    }
  });
  ids.resize(tokens * top_k);
  chosen_weights.resize(tokens * top_k);
  std::vector<int64_t> order(experts);
  if (choice_bias != nullptr) {
    std::vector<float> choice(experts);
    for (int64_t t = 0; t < tokens; ++t) {
      float* scores = logits.data() + t * experts;
      for (int64_t e = 0; e < experts; ++e) {
        scores[e] = 1.f / (1.f + std::exp(-scores[e]));
        choice[e] = scores[e] + choice_bias[e];
        order[e] = e;
      }
      std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
      });
      float kept = 0;
      for (int64_t j = 0; j < top_k; ++j) kept += scores[order[j]];
      const float divisor = renormalize ? kept + 1e-20f : 1.f;
      for (int64_t j = 0; j < top_k; ++j) {
        ids[t * top_k + j] = order[j];
        chosen_weights[t * top_k + j] = scores[order[j]] / divisor * scaling;
      }
    }
    return;
  }
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits.data() + t * experts;
    const float top = *std::max_element(row, row + experts);
    float sum = 0;
    for (int64_t e = 0; e < experts; ++e) sum += std::exp(row[e] - top);
    for (int64_t e = 0; e < experts; ++e) order[e] = e;
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    float kept = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const float p = std::exp(row[order[j]] - top) / sum;
      ids[t * top_k + j] = order[j];
      chosen_weights[t * top_k + j] = p;
      kept += p;
    }
    if (renormalize)
      for (int64_t j = 0; j < top_k; ++j) chosen_weights[t * top_k + j] /= kept;
  }
}

// A MoE layer in one call (decode; every batch where BLAS is not used): routing (`route`),
// then the (token, slot) pairs grouped by expert, stably, as grouped_experts (layers/moe.py)
// groups them; every gate|up product, reading its tokens' rows of x in place, in one parallel
// region, then SiLU(gate) * up, then every down product in a second region; last each
// token's outputs weighted and added in expert order. A token's operations do not depend on
// the others in its batch. Experts come stacked (`weight_of`, `expert_of`): gate|up weights
// hold 2 * inter rows (gate, then up), downs hidden rows. gpt-oss's experts add biases (the
// router's to its scores, each expert's gate|up and down rows to its products) and gate by
// the clamped SwiGLU (`swiglu_limit` > 0): (up + 1) * gate * sigmoid(alpha * gate), gate
// clamped above and up on both sides, in ATen's ops as layers/moe.activate writes them.
// GLM-4.5's route by sigmoid scores (`choice_bias`, `routed_scaling`: `route`).
at::Tensor moe_layer(
    const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool renormalize,
    const at::Tensor& up_words, const at::Tensor& up_scales, const at::Tensor& up_offsets,
    const at::Tensor& up_bases, int64_t up_group, int64_t up_code_bits,
    const std::optional<at::Tensor>& up_levels, const at::Tensor& down_words,
    const at::Tensor& down_scales, const at::Tensor& down_offsets, const at::Tensor& down_bases,
    int64_t down_group, int64_t down_code_bits, const std::optional<at::Tensor>& down_levels,
    int64_t inter, const std::optional<at::Tensor>& router_bias,
    const std::optional<at::Tensor>& up_bias, const std::optional<at::Tensor>& down_bias,
    double swiglu_alpha, double swiglu_limit, const std::optional<at::Tensor>& choice_bias,
    double routed_scaling) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 matrix");
  for (const auto* bias : {&router_bias, &up_bias, &down_bias, &choice_bias})
    TORCH_CHECK(!*bias || ((*bias)->scalar_type() == at::kFloat && (*bias)->is_contiguous()),
                "biases: contiguous float32");
  const int64_t experts = router.size(0), hidden = x.size(1);
  TORCH_CHECK(up_scales.dim() == 4 && up_scales.size(0) == experts && down_scales.dim() == 4 &&
                  down_scales.size(0) == experts,
              "gate|up and down weights stacked for each of the router's ", experts, " experts");
  const Weight up0 =
      weight_of(up_words, up_scales, up_offsets, up_bases, up_group, up_code_bits, up_levels);
  const Weight down0 = weight_of(down_words, down_scales, down_offsets, down_bases, down_group,
                                 down_code_bits, down_levels);
  const int64_t width = up0.panels * kLanes, down_width = down0.panels * kLanes;
  TORCH_CHECK(width >= 2 * inter && down_width >= hidden && up0.cols == hidden &&
                  down0.cols == inter,
              "gate|up weights need 2 x ", inter, " outputs of ", hidden, " inputs and downs ",
              hidden, " of ", inter);
  TORCH_CHECK(!router_bias || router_bias->numel() == experts, "one router bias an expert");
  TORCH_CHECK(!choice_bias || choice_bias->numel() == experts, "one choice bias an expert");
  TORCH_CHECK(!up_bias || (up_bias->dim() == 2 && up_bias->size(0) == experts &&
                           up_bias->size(1) == 2 * inter),
              "gate|up biases: [experts, 2 x inter]");
  TORCH_CHECK(!down_bias || (down_bias->dim() == 2 && down_bias->size(0) == experts &&
                             down_bias->size(1) == hidden),
              "down biases: [experts, hidden]");
  std::vector<int64_t> id;
  std::vector<float> routing;
  route(x, router, router_bias ? router_bias->data_ptr<float>() : nullptr, top_k, renormalize,
        choice_bias ? choice_bias->data_ptr<float>() : nullptr,
        static_cast<float>(routed_scaling), id, routing);

  // Each chosen expert's pairs, in pair order: the tokens its gate|up reads, the rows of the
  // outputs that follow.
  const int64_t tokens = x.size(0), pair_count = tokens * top_k;
  std::vector<std::vector<int64_t>> tokens_of(experts);
  for (int64_t p = 0; p < pair_count; ++p) tokens_of[id[p]].push_back(p / top_k);
  std::vector<int64_t> chosen, first{0}, row_of_pair(pair_count);
  std::vector<int64_t> seen(experts, 0);
  for (int64_t e = 0; e < experts; ++e) {
    if (tokens_of[e].empty()) continue;
    chosen.push_back(e);
    seen[e] = first.back();
    first.push_back(first.back() + static_cast<int64_t>(tokens_of[e].size()));
  }
  for (int64_t p = 0; p < pair_count; ++p) row_of_pair[p] = seen[id[p]]++;
  const int64_t total = first.back();
  // Outputs are written before they are read: no zeroing (at 2,048 tokens these are tens of MB).
  at::Tensor ys = at::empty({total, width}, x.options());
  at::Tensor downs_y = at::empty({total, down_width}, x.options());
  float* yp = ys.data_ptr<float>();
  float* dp = downs_y.data_ptr<float>();
  std::vector<Product> ups, downs;
  for (size_t c = 0; c < chosen.size(); ++c) {
    const int64_t rows = first[c + 1] - first[c];
    ups.push_back(product_at(x.data_ptr<float>(), rows, expert_of(up0, chosen[c]),
                             yp + first[c] * width, tokens_of[chosen[c]].data(), hidden));
  }
  run(ups);
  if (up_bias)
    for (size_t c = 0; c < chosen.size(); ++c)
      ys.narrow(0, first[c], first[c + 1] - first[c])
          .narrow(1, 0, 2 * inter)
          .add_((*up_bias)[chosen[c]]);
  // The gate through ATen's vectorized kernels, once for every chosen expert's rows, into the
  // gate's columns, where the downs read it.
  at::Tensor gate = ys.narrow(1, 0, inter);
  if (swiglu_limit > 0) {
    const at::Tensor clamped = gate.clamp_max(swiglu_limit);
    const at::Tensor up = ys.narrow(1, inter, inter).clamp(-swiglu_limit, swiglu_limit);
    at::mul_out(gate, up.add(1), clamped.mul(at::sigmoid(clamped.mul(swiglu_alpha))));
  } else {
    at::mul_out(gate, at::silu(gate), ys.narrow(1, inter, inter));
  }
  for (size_t c = 0; c < chosen.size(); ++c) {
    const int64_t rows = first[c + 1] - first[c];
    downs.push_back(product_at(yp + first[c] * width, rows, expert_of(down0, chosen[c]),
                               dp + first[c] * down_width, nullptr, width));
  }
  run(downs);
  if (down_bias)
    for (size_t c = 0; c < chosen.size(); ++c)
      downs_y.narrow(0, first[c], first[c + 1] - first[c])
          .narrow(1, 0, hidden)
          .add_((*down_bias)[chosen[c]]);
  // Each token's outputs weighted and added in expert order.
  at::Tensor out = at::empty_like(x);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> mine(top_k);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t j = 0; j < top_k; ++j) mine[j] = t * top_k + j;
      std::sort(mine.begin(), mine.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
      float* o = op + t * hidden;
      std::fill_n(o, hidden, 0.0f);
      for (int64_t p : mine) {
        const float* y = dp + row_of_pair[p] * down_width;
        const float w = routing[p];
        for (int64_t h = 0; h < hidden; ++h) o[h] += y[h] * w;
      }
    }
  });
  return out;
}

// Rows `ids` of the weight de-quantized (embedding lookups), w = code * scale + offset.
at::Tensor rows(const at::Tensor& words, const at::Tensor& scales, const at::Tensor& offsets,
                const at::Tensor& bases, int64_t group, int64_t code_bits,
                const std::optional<at::Tensor>& levels, const at::Tensor& ids) {
  if (aserve_float::holds(words)) return aserve_float::rows(words, ids);
  const Weight w = weight_of(words, scales, offsets, bases, group, code_bits, levels);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids: int64 vector");
  const at::Tensor ids_here = ids.contiguous();
  const int64_t* idp = ids_here.data_ptr<int64_t>();
  const int64_t count = ids.size(0);
  at::Tensor out = at::empty({count, w.cols}, scales.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t per_word = w.inputs_per_word(), words_in_group = w.words_per_group();
  std::vector<uint32_t> widened;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t n = idp[i];
    TORCH_CHECK(n >= 0 && n < w.panels * kLanes, "row ", n, " is outside the weight");
    const int64_t lane = n % kLanes;
    int64_t panel = n / kLanes;
    const Weight weight = w.widens() ? widen(w, panel, 1, widened) : w;
    if (w.widens()) panel = 0;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float scale = weight.scale(panel, g, lane);
      const float offset = weight.offset(panel, g, lane);
      const uint32_t* group_words =
          weight.words + panel * weight.panel_words() + g * words_in_group * kLanes;
      for (int64_t v = 0; v < weight.code_words(); ++v) {
        const uint32_t word = group_words[v * kLanes + lane];
        const uint32_t high = weight.split ? high_bits(weight, group_words, v, lane) : 0;
        for (int64_t j = 0; j < per_word; ++j) {
          const float value = code_of(weight, word, static_cast<int>(j), high);
          op[i * w.cols + g * w.group + v * per_word + j] = std::fma(value, scale, offset);
        }
      }
    }
  }
  return out;
}

#ifdef ASERVE_AVX2
// One word of each lane de-quantized, `code * scale + offset`, input i to out[i * stride].
template <Kind K>
inline void dequantize_word(const Weight& w, const uint32_t* group_words, int64_t v, float center,
                            __m256 scale, __m256 offset, __m256i levels, float* out,
                            int64_t stride) {
  constexpr int per_word = K == Kind::kBytes ? 4 : 8;
  const Unpacked word = unpack_word<K>(w, group_words, v, levels);
  for (int i = 0; i < per_word; ++i) {
    _mm256_storeu_ps(out + i * stride, _mm256_fmadd_ps(code_of<K>(word, i, center), scale, offset));
  }
}
#endif

// Panels [first, first + out.size(1) / 8) de-quantized, w = fma(code, scale, offset), into
// `out` as a [cols, 8 * panels] matrix (input-major, the layout the panels already have): many
// rows multiply it with BLAS, whose tuned product beats any loop here once the expansion is
// shared by enough rows. `out` is the caller's reused buffer: a fresh one of a few MiB cost
// as much in page faults as the expansion itself.
void dequantize(const at::Tensor& words, const at::Tensor& scales, const at::Tensor& offsets,
                const at::Tensor& bases, int64_t group, int64_t code_bits,
                const std::optional<at::Tensor>& levels, int64_t first, at::Tensor out) {
  if (aserve_float::holds(words)) return aserve_float::dequantize(words, first, out);
  const Weight stored = weight_of(words, scales, offsets, bases, group, code_bits, levels);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.size(0) == stored.cols && out.size(1) % kLanes == 0,
              "out: contiguous float32 [cols, 8 * panels]");
  const int64_t width = out.size(1);
  int64_t last = first + width / kLanes;
  TORCH_CHECK(0 <= first && first < last && last <= stored.panels, "panels out of range");
  std::vector<uint32_t> widened;  // 3-bit codes, entries: the slice's panels as nibbles, from 0
  const Weight w = stored.widens() ? widen(stored, first, last - first, widened) : stored;
  if (stored.widens()) {
    last -= first;
    first = 0;
  }
  float* op = out.data_ptr<float>();
  const int64_t per_word = w.inputs_per_word(), words_in_group = w.words_per_group();
#ifdef ASERVE_AVX2
  const Kind kind = kind_of(w);
  const __m256i table = levels_of(w);
  const float center = static_cast<float>(split_center(w));
#endif
  // Group-major, so each thread writes its rows of `out` front to back (one sequential
  // stream per input of the group) instead of a strip of 8 floats per row.
  at::parallel_for(0, w.groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t p = first; p < last; ++p) {
        float* column = op + (p - first) * kLanes;
        const uint32_t* group_words = w.words + p * w.panel_words() + g * words_in_group * kLanes;
        for (int64_t v = 0; v < w.code_words(); ++v) {
          const int64_t k0 = g * w.group + v * per_word;
#ifdef ASERVE_AVX2
          __m256 scale, offset;
          w.scales_and_offsets8(w.spot(p, g), scale, offset);
          float* at = column + k0 * width;
          switch (kind) {
            case Kind::kNibbles:
              dequantize_word<Kind::kNibbles>(w, group_words, v, 0, scale, offset, table, at, width);
              break;
            case Kind::kBytes:
              dequantize_word<Kind::kBytes>(w, group_words, v, 0, scale, offset, table, at, width);
              break;
            case Kind::kLevels:
              dequantize_word<Kind::kLevels>(w, group_words, v, 0, scale, offset, table, at, width);
              break;
            case Kind::kSplit:
              dequantize_word<Kind::kSplit>(w, group_words, v, center, scale, offset, table, at,
                                            width);
              break;
          }
#else
          for (int64_t lane = 0; lane < kLanes; ++lane) {
            const uint32_t high = w.split ? high_bits(w, group_words, v, lane) : 0;
            for (int64_t i = 0; i < per_word; ++i) {
              column[(k0 + i) * width + lane] =
                  std::fma(code_of(w, group_words[v * kLanes + lane], static_cast<int>(i), high),
                           w.scale(p, g, lane), w.offset(p, g, lane));
            }
          }
#endif
        }
      }
    }
  });
}

// The small per-layer steps of a decoder, one pass each instead of several ATen ops: at batch
// 1 on a 135M model their dispatch cost as much as the products. float32, rows of the last
// dimension contiguous (the row stride is free: Q and K are views into the fused QKV output).
struct Matrix {
  float* data;
  int64_t rows, cols, stride;
};

Matrix rows_of(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.stride(1) == 1,
              "a float32 matrix with contiguous rows");
  return {t.data_ptr<float>(), t.size(0), t.size(1), t.stride(0)};
}

inline void norm_row(const float* in, float* out, const float* weight, int64_t n, double eps) {
  float squares = 0;
  for (int64_t j = 0; j < n; ++j) squares += in[j] * in[j];
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t j = 0; j < n; ++j) out[j] = in[j] * inverse * weight[j];
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const Matrix in = rows_of(x);
  at::Tensor y = at::empty({in.rows, in.cols}, x.options());
  const float* w = weight.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, in.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) norm_row(in.data + i * in.stride, out + i * in.cols, w, in.cols, eps);
  });
  return y;
}

// residual += x, then x = norm(residual) * weight, both in place.
void fused_add_rmsnorm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  const Matrix a = rows_of(x), r = rows_of(residual);
  TORCH_CHECK(a.rows == r.rows && a.cols == r.cols, "x and residual differ in shape");
  const float* w = weight.data_ptr<float>();
  at::parallel_for(0, a.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* xi = a.data + i * a.stride;
      float* ri = r.data + i * r.stride;
      for (int64_t j = 0; j < a.cols; ++j) ri[j] += xi[j];
      norm_row(ri, xi, w, a.cols, eps);
    }
  });
}

// One layer's Q/K norm (Qwen3's, where weights are given), RoPE and KV write in one pass a
// token, as layers/rope_store.py's kernel does on CUDA: Q normalised and rotated in place, K
// normalised and rotated into the pool at the token's slot, V copied beside it (in float32,
// or in float16 rounded to nearest as torch's cast rounds). K in the QKV output is left as it
// was: attention reads the pool. Neox-style rotation, cos_sin[position] = (cos | sin).
template <typename T>
void norm_rope_store_as(const Matrix& q, const Matrix& kv, const int64_t* pos, const float* table,
                        int64_t width, const float* q_weight, const float* k_weight, float eps,
                        T* cache, const int64_t* slots, int64_t head_size) {
  const int64_t half = head_size / 2, kv_heads = kv.cols / (2 * head_size);
  auto norm_rotate = [&](const float* in, float* out, const float* weight, const float* cos) {
    float inverse = 1.0f;
    if (weight != nullptr) {
      float squares = 0;
      for (int64_t j = 0; j < head_size; ++j) squares += in[j] * in[j];
      inverse = 1.0f / std::sqrt(squares / static_cast<float>(head_size) + eps);
    }
    const float* sin = cos + half;
    for (int64_t j = 0; j < half; ++j) {
      float a = in[j], b = in[j + half];
      if (weight != nullptr) {
        a = a * inverse * weight[j];
        b = b * inverse * weight[j + half];
      }
      out[j] = a * cos[j] - b * sin[j];
      out[j + half] = b * cos[j] + a * sin[j];
    }
  };
  at::parallel_for(0, q.rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(head_size);
    for (int64_t t = begin; t < end; ++t) {
      const float* cos = table + pos[t] * width;
      float* q_row = q.data + t * q.stride;
      for (int64_t h = 0; h < q.cols; h += head_size) norm_rotate(q_row + h, q_row + h, q_weight, cos);
      const float* k_row = kv.data + t * kv.stride;
      const float* v_row = k_row + kv_heads * head_size;
      T* slot = cache + slots[t] * kv.cols;
      for (int64_t h = 0; h < kv_heads * head_size; h += head_size) {
        norm_rotate(k_row + h, rotated.data(), k_weight, cos);
        for (int64_t j = 0; j < head_size; ++j) slot[h + j] = static_cast<T>(rotated[j]);
      }
      T* v_slot = slot + kv_heads * head_size;
      for (int64_t j = 0; j < kv_heads * head_size; ++j) v_slot[j] = static_cast<T>(v_row[j]);
    }
  });
}

void norm_rope_store(at::Tensor query, const at::Tensor& kv, const at::Tensor& positions,
                     const at::Tensor& cos_sin, const std::optional<at::Tensor>& q_weight,
                     const std::optional<at::Tensor>& k_weight, double eps, at::Tensor cache,
                     const at::Tensor& slots, int64_t head_size) {
  const Matrix q = rows_of(query), k = rows_of(kv);
  const int64_t tokens = q.rows;
  TORCH_CHECK(k.rows == tokens && positions.numel() == tokens && slots.numel() == tokens,
              "one position and slot a token");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "positions and slots: contiguous int64");
  TORCH_CHECK(head_size % 2 == 0 && q.cols % head_size == 0 && k.cols % (2 * head_size) == 0,
              "Q and KV rows are whole heads");
  const bool half = cache.scalar_type() == at::kHalf;
  TORCH_CHECK(cache.dim() == 4 && cache.size(1) == 2 && cache.size(3) == head_size &&
                  2 * cache.size(2) * head_size == k.cols && cache.is_contiguous() &&
                  (half || cache.scalar_type() == at::kFloat),
              "cache: the pool's contiguous float32 or float16 layer [slots, 2, kv_heads, head_dim]");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.dim() == 2 && cos_sin.size(1) == head_size,
              "cos_sin: float32 [positions, head_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos_sin.size(0), "a position is past the rope table");
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache.size(0), "a slot is outside the pool");
  }
  auto norm_weight = [&](const std::optional<at::Tensor>& w) -> const float* {
    if (!w.has_value()) return nullptr;
    TORCH_CHECK(w->scalar_type() == at::kFloat && w->numel() == head_size && w->is_contiguous(),
                "norm weights: float32 [head_dim]");
    return w->data_ptr<float>();
  };
  const float* qw = norm_weight(q_weight);
  const float* kw = norm_weight(k_weight);
  const float* table = cos_sin.data_ptr<float>();
  if (half) {
    norm_rope_store_as(q, k, pos, table, cos_sin.size(1), qw, kw, static_cast<float>(eps),
                       static_cast<c10::Half*>(cache.data_ptr()), slot, head_size);
  } else {
    norm_rope_store_as(q, k, pos, table, cos_sin.size(1), qw, kw, static_cast<float>(eps),
                       cache.data_ptr<float>(), slot, head_size);
  }
}

#ifndef ASERVE_AMX
bool amx_tiles(std::optional<bool>) { return false; }  // no AMX tiles in this build
#endif

}  // namespace

TORCH_LIBRARY(aserve_cpu, m) {
  m.def(
      "linear(Tensor x, Tensor words, Tensor scales, Tensor offsets, Tensor bases, int group, "
      "int code_bits, Tensor? levels) -> Tensor",
      linear);
  m.def(
      "gated_linear(Tensor x, Tensor words, Tensor scales, Tensor offsets, Tensor bases, "
      "int group, int code_bits, Tensor? levels, int inter) -> Tensor",
      gated_linear);
  m.def(
      "linear_group(Tensor[] xs, Tensor[] words, Tensor[] scales, Tensor[] offsets, "
      "Tensor[] bases, int group, int code_bits, Tensor? levels) -> Tensor[]",
      linear_group);
  m.def(
      "moe_layer(Tensor x, Tensor router, int top_k, bool renormalize, Tensor up_words, "
      "Tensor up_scales, Tensor up_offsets, Tensor up_bases, int up_group, int up_code_bits, "
      "Tensor? up_levels, Tensor down_words, Tensor down_scales, Tensor down_offsets, "
      "Tensor down_bases, int down_group, int down_code_bits, Tensor? down_levels, int inter, "
      "Tensor? router_bias=None, Tensor? up_bias=None, Tensor? down_bias=None, "
      "float swiglu_alpha=1.0, float swiglu_limit=0.0, Tensor? choice_bias=None, "
      "float routed_scaling=1.0) -> Tensor",
      moe_layer);
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor", rmsnorm);
  m.def("fused_add_rmsnorm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        fused_add_rmsnorm);
  m.def(
      "norm_rope_store(Tensor(a!) q, Tensor kv, Tensor positions, Tensor cos_sin, Tensor? q_weight, "
      "Tensor? k_weight, float eps, Tensor(b!) cache, Tensor slots, int head_size) -> ()",
      norm_rope_store);
  m.def(
      "rows(Tensor words, Tensor scales, Tensor offsets, Tensor bases, int group, int code_bits, "
      "Tensor? levels, Tensor ids) -> Tensor",
      rows);
  m.def(
      "dequantize(Tensor words, Tensor scales, Tensor offsets, Tensor bases, int group, "
      "int code_bits, Tensor? levels, int first, Tensor(a!) out) -> ()",
      dequantize);
  m.def("int_activations(bool? enable=None, int code_bits=4) -> bool", int_activations);
  m.def("one_row_prefetch(bool? enable=None) -> bool", one_row_prefetch);
  m.def("amx_tiles(bool? enable=None) -> bool", amx_tiles);
  m.def("three_bit_in_registers() -> bool", three_bit_in_registers);
  m.def("dot_products() -> bool", dot_products);
}
