// Tessera's own GEMM for y = x @ W^T: W is packed once into panels of output columns, each panel
// one contiguous block read front to back, and a register tile holds the fp32 sums of a few rows
// times one panel.
// - AVX-512: 48-column panels ([K][48] fp32, or [K/2][48][2] bf16: the pair-interleaved operand of
//   vdpbf16ps, where AVX512-BF16 is), 8 rows x 48 columns (24 zmm, plus 3 for the weights and 1
//   for the broadcast input). Without AVX512-BF16 (Ice Lake, Cascade Lake, Skylake) bf16 weights
//   stay bf16 in memory and are widened in registers, as on AVX2 below.
// - AVX2 + FMA (no AVX-512): 16-column panels ([K][16]), 6 rows x 16 columns (12 ymm, plus 2 for
//   the weights and 1 for the input, as BLIS's Haswell kernel). bf16 weights stay bf16 in memory,
//   ordered so that interleaving them with zero words (one vpunpck{l,h}wd each) widens them to fp32
//   in column order; the inputs are widened to fp32 once per call.
//
// Why: a decode step multiplies a few dozen rows by every weight of the model, which then
// streams from DRAM once per step. Measured on an EPYC Genoa (2 threads, SmolLM2's 30 layers of
// shapes, weights cold), the AVX-512 panels ran 13% faster than oneDNN's prepacked layout at 64
// rows in fp32 and up to 35% faster at 8-48 rows, in bf16 by 13-30%; at 512-2048 rows the two are
// level. The weight stream is linear, so the hardware prefetcher keeps ahead of it. On an EPYC
// Milan (AVX2 only) the AVX2 panels ran at 180-195 GFLOP/s at 64-2048 rows in fp32 with the
// weights hot, oneDNN at 140-165.
//
// Sums run over k in order, in fp32 for both input dtypes; bf16 outputs are rounded to nearest
// even (simd.h's bf16_bits). The caller hands the work items (PanelWork) out to its threads.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "panel_layout.h"
#include "simd.h"

namespace tessera::panels {

// A panel is kVectors vectors of simd.h's kLanes floats wide.
#if defined(__AVX512F__)
#define TESSERA_PANELS_AVX512 1
constexpr int64_t kVectors = 3, kTileRows = 8;
#elif defined(__AVX2__) && defined(__FMA__)
#define TESSERA_PANELS_AVX2 1
constexpr int64_t kVectors = 2, kTileRows = 6;
#else
constexpr int64_t kVectors = 2, kTileRows = 6;  // shapes only: no kernel on this CPU
#endif
constexpr int64_t kCols = kLanes * kVectors;  // output columns per panel

inline int64_t panel_count(int64_t n) { return (n + kCols - 1) / kCols; }
// Gated panels (GatedRows) for SwiGLU outputs of the given width: kCols / 2 outputs each.
inline int64_t gated_panel_count(int64_t width) { return (width + kCols / 2 - 1) / (kCols / 2); }

#if defined(TESSERA_PANELS_AVX512) || defined(TESSERA_PANELS_AVX2)
constexpr bool kFp32 = true;
#else
constexpr bool kFp32 = false;
#endif
// bf16 as input pairs for vdpbf16ps, or (AVX2, AVX-512 without AVX512-BF16) widened to fp32 in
// the register tile.
#if defined(TESSERA_PANELS_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kBf16 = true, kBf16Pairs = true;
#elif (defined(TESSERA_PANELS_AVX512) && defined(__AVX512BW__)) || defined(TESSERA_PANELS_AVX2)
constexpr bool kBf16 = true, kBf16Pairs = false;
#else
constexpr bool kBf16 = false, kBf16Pairs = false;
#endif
// Whether bf16 inputs x are widened to fp32 before the panels multiply them.
constexpr bool kWidenBf16Inputs = kBf16 && !kBf16Pairs;

// Where column col of a panel's k-row sits among its kCols bf16 words on the widening path:
// the first two vectors are widened from one load by vpunpcklwd/vpunpckhwd, which take words 0-3
// / 4-7 of each 128-bit lane, so 4-column runs alternate between them; AVX-512's third vector
// is widened from a load of its own by vpmovzxwd, in column order.
constexpr int64_t widened_word(int64_t col) {
  const int64_t vector = col / kLanes, lane = col % kLanes;
  return vector < 2 ? 8 * (lane / 4) + 4 * vector + lane % 4 : col;
}

using PlainRows = PlainPanelRows<kCols>;
using GatedRows = GatedPanelRows<kCols>;

// The panels' layout (panel_layout.h's pack_panel) for T = float or uint16_t bf16 bits: K
// unpadded; fp32: element (col, i) at [i][col]; bf16: at [i / 2][col][i % 2] (pairs, k even) or at
// [i][widened_word(col)].
template <typename T>
struct Layout {
  static constexpr int64_t kCols = panels::kCols;
  static constexpr bool kPairs = sizeof(T) == 2 && kBf16Pairs, kWidened = sizeof(T) == 2 && !kBf16Pairs;
  static int64_t padded_k(int64_t k) { return k; }
  static int64_t offset(int64_t i, int64_t col) {
    if constexpr (kPairs) return (i / 2) * kCols * 2 + col * 2 + i % 2;
    return i * kCols + (kWidened ? widened_word(col) : col);
  }
};

#if defined(TESSERA_PANELS_AVX512)

// Lanes of each of the panel's three vectors that hold real columns (the last panel may be short).
struct ColumnMasks {
  __mmask16 lane[3];
  explicit ColumnMasks(int64_t cols) {
    for (int v = 0; v < 3; ++v) {
      const int64_t live = std::clamp<int64_t>(cols - 16 * v, 0, 16);
      lane[v] = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    }
  }
};

inline void store(float* y, __m512 sum, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, sum); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline void store(uint16_t* y, __m512 sum, __mmask16 mask) {
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
}
#else
inline void store(uint16_t* y, __m512 sum, __mmask16 mask) {  // narrowed as it is stored
  _mm512_mask_cvtepi32_storeu_epi16(y, mask, reinterpret_cast<__m512i>(bf16_bits(sum)));
}
#endif

// One k step's 48 weights as three vectors of fp32: bf16 widened (the panel laid out by
// widened_word; a bf16 is the top half of its fp32, so a zero word goes below each one).
inline void load_weights(const float* w, __m512 (&out)[3]) {
  out[0] = _mm512_loadu_ps(w);
  out[1] = _mm512_loadu_ps(w + 16);
  out[2] = _mm512_loadu_ps(w + 32);
}

#if defined(__AVX512BW__)
inline void load_weights(const uint16_t* w, __m512 (&out)[3]) {
  const __m512i first_two = _mm512_loadu_si512(w);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), first_two));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), first_two));
  const __m256i third = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  out[2] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(third), 16));
}
#endif

using Sums = __m512[3];  // one tile row's sums: the panel's 48 columns

// The plain epilogue: a tile row's sums are its outputs, at the panel's columns.
struct StoreSums {
  static constexpr int64_t kOutCols = kCols;
  template <typename T>
  void operator()(T* y, const Sums& sum, const ColumnMasks& masks) const {
    for (int v = 0; v < 3; ++v) store(y + 16 * v, sum[v], masks.lane[v]);
  }
};

// Rows [0, R) of x (T, or fp32 where bf16 inputs are widened by the caller) times one panel,
// each row's sums (plus the panel's fp32 bias when given) written by the epilogue at y + r * ldy.
template <int R, typename In, typename T, typename Epilogue>
inline void tile(const In* x, int64_t k, const T* panel, const float* bias, const ColumnMasks& masks, T* y,
                 int64_t ldy, const char* prefetch, int64_t prefetch_lines, const Epilogue& epilogue) {
  __m512 sum[R][3];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = sum[r][2] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<In, float>) {
    for (int64_t i = 0; i < k; ++i) {
      if (i < prefetch_lines) _mm_prefetch(prefetch + i * 64, _MM_HINT_T1);
      __m512 w[3];
      load_weights(panel + i * kCols, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 in = _mm512_set1_ps(x[r * k + i]);
        sum[r][0] = _mm512_fmadd_ps(in, w[0], sum[r][0]);
        sum[r][1] = _mm512_fmadd_ps(in, w[1], sum[r][1]);
        sum[r][2] = _mm512_fmadd_ps(in, w[2], sum[r][2]);
      }
    }
  } else {
#if defined(__AVX512BF16__)
    for (int64_t i = 0; i < k / 2; ++i) {
      if (i < prefetch_lines) _mm_prefetch(prefetch + i * 64, _MM_HINT_T1);
      const T* w = panel + i * kCols * 2;
      const auto w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
      const auto w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
      const auto w2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 64));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;  // inputs 2i and 2i+1 of row r, broadcast as one 32-bit lane
        std::memcpy(&pair, x + r * k + 2 * i, sizeof(pair));
        const auto in = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        sum[r][0] = _mm512_dpbf16_ps(sum[r][0], in, w0);
        sum[r][1] = _mm512_dpbf16_ps(sum[r][1], in, w1);
        sum[r][2] = _mm512_dpbf16_ps(sum[r][2], in, w2);
      }
    }
#endif
  }
  if (bias != nullptr) {  // the short last panel's bias reads only its real columns
    const __m512 b0 = _mm512_maskz_loadu_ps(masks.lane[0], bias), b1 = _mm512_maskz_loadu_ps(masks.lane[1], bias + 16),
                 b2 = _mm512_maskz_loadu_ps(masks.lane[2], bias + 32);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sum[r][0] = _mm512_add_ps(sum[r][0], b0);
      sum[r][1] = _mm512_add_ps(sum[r][1], b1);
      sum[r][2] = _mm512_add_ps(sum[r][2], b2);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) epilogue(y + r * ldy, sum[r], masks);
}

#elif defined(TESSERA_PANELS_AVX2)

// The panel's real columns (the last panel may be short): a short panel's bias and outputs go
// through a full-width buffer.
struct ColumnMasks {
  int64_t live;
  explicit ColumnMasks(int64_t cols) : live(std::min(cols, kCols)) {}
};

inline void store_full(float* y, const __m256 (&sum)[2]) {
  _mm256_storeu_ps(y, sum[0]);
  _mm256_storeu_ps(y + 8, sum[1]);
}

inline void store_full(uint16_t* y, const __m256 (&sum)[2]) {
  // packus interleaves 64-bit halves of its operands per 128-bit lane; the permute restores order.
  const __m256i words = _mm256_packus_epi32(reinterpret_cast<__m256i>(bf16_bits(sum[0])),
                                            reinterpret_cast<__m256i>(bf16_bits(sum[1])));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute4x64_epi64(words, 0xD8));
}

using Sums = __m256[2];  // one tile row's sums: the panel's 16 columns

// The plain epilogue: a tile row's sums are its outputs, at the panel's columns.
struct StoreSums {
  static constexpr int64_t kOutCols = kCols;
  template <typename T>
  void operator()(T* y, const Sums& sum, const ColumnMasks& masks) const {
    if (masks.live == kCols) return store_full(y, sum);
    T buffer[kCols];
    store_full(buffer, sum);
    std::memcpy(y, buffer, masks.live * sizeof(T));
  }
};

// Rows [0, R) of x (fp32, bf16 inputs widened by the caller) times one panel of fp32 or bf16
// weights, each row's sums (plus the panel's fp32 bias when given) written by the epilogue at
// y + r * ldy.
template <int R, typename T, typename Epilogue>
inline void tile(const float* x, int64_t k, const T* panel, const float* bias, const ColumnMasks& masks, T* y,
                 int64_t ldy, const char* prefetch, int64_t prefetch_lines, const Epilogue& epilogue) {
  __m256 sum[R][2];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    if (i < prefetch_lines) _mm_prefetch(prefetch + i * 64, _MM_HINT_T1);
    __m256 w0, w1;
    if constexpr (sizeof(T) == 4) {
      w0 = _mm256_loadu_ps(panel + i * kCols);
      w1 = _mm256_loadu_ps(panel + i * kCols + 8);
    } else {  // a bf16 is the top half of its fp32: interleave zero words below each one
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + i * kCols));
      w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), words));
      w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), words));
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 in = _mm256_broadcast_ss(x + r * k + i);
      sum[r][0] = _mm256_fmadd_ps(in, w0, sum[r][0]);
      sum[r][1] = _mm256_fmadd_ps(in, w1, sum[r][1]);
    }
  }
  if (bias != nullptr) {
    float padded[kCols] = {};
    std::memcpy(padded, bias, masks.live * sizeof(float));
    const __m256 b0 = _mm256_loadu_ps(padded), b1 = _mm256_loadu_ps(padded + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      sum[r][0] = _mm256_add_ps(sum[r][0], b0);
      sum[r][1] = _mm256_add_ps(sum[r][1], b1);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) epilogue(y + r * ldy, sum[r], masks);
}

#else

struct StoreSums {  // no kernel on this CPU: the shape only
  static constexpr int64_t kOutCols = kCols;
};

#endif

#if defined(TESSERA_PANELS_AVX512) || defined(TESSERA_PANELS_AVX2)

// All m rows of x [m][k] times panel `panel`, into its Epilogue::kOutCols columns of y [m][n]
// (rows ldy apart); bias is the whole fp32 bias [n] (plain panels only), or null. In is T, or
// float where bf16 inputs are widened (kWidenBf16Inputs).
template <typename In, typename T, typename Epilogue>
void multiply_panel(const In* x, int64_t m, int64_t k, const T* packed, int64_t n, int64_t ldy, int64_t panel,
                    const float* bias, T* y, const T* next_panel, const Epilogue& epilogue) {
  constexpr int64_t out_cols = Epilogue::kOutCols;
  const T* weights = packed + panel * k * kCols;
  const ColumnMasks masks(n - panel * out_cols);
  const float* panel_bias = bias == nullptr ? nullptr : bias + panel * kCols;
  T* out = y + panel * out_cols;
  // The next panel this thread multiplies (next_panel, null for none) is requested into L2
  // while this one's row tiles run (a share of its lines per tile, one line per k step), so the
  // next panel's first tile does not wait on DRAM: the hardware prefetcher alone kept it
  // waiting at decode's 64 rows. On a 2-core EPYC Turin VM, fp32 at 64 rows ran 8-11% faster
  // for the MLP shapes (3072x576, 576x1536) and level for the attention ones, level at 512-2048
  // rows; the offline workload 5% faster in fp32 (10.6 -> 10.1 s) and 3% in bf16.
  // A tile requests at most one line per k step, so with few tiles (few rows) only the start of
  // the next panel is requested, without gaps, and the hardware prefetcher streams the rest.
  const int64_t panel_lines = k * kCols * static_cast<int64_t>(sizeof(T)) / 64;
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  const int64_t steps = sizeof(T) == 2 && kBf16Pairs ? k / 2 : k;
  const int64_t lines_per_tile = next_panel != nullptr ? std::min(steps, (panel_lines + tiles - 1) / tiles) : 0;
  const char* next = reinterpret_cast<const char*>(next_panel);
  for (int64_t row = 0; row < m; row += kTileRows) {
    const In* in = x + row * k;
    T* tile_out = out + row * ldy;
    const int64_t done = row / kTileRows * lines_per_tile;
    const char* prefetch = next + done * 64;
    const int64_t prefetch_lines = std::max<int64_t>(0, std::min(lines_per_tile, panel_lines - done));
    switch (std::min(kTileRows, m - row)) {
#define TESSERA_TILE(R) \
  case R:               \
    tile<R>(in, k, weights, panel_bias, masks, tile_out, ldy, prefetch, prefetch_lines, epilogue); \
    break;
      TESSERA_TILE(1)
      TESSERA_TILE(2)
      TESSERA_TILE(3)
      TESSERA_TILE(4)
      TESSERA_TILE(5)
      TESSERA_TILE(6)
#if defined(TESSERA_PANELS_AVX512)
      TESSERA_TILE(7)
      TESSERA_TILE(8)
#endif
#undef TESSERA_TILE
    }
  }
}

// A multiplication's work items: a block of rows times a run of panels each, row blocks
// outermost so the threads share one block of x at a time. Threads take items dynamically:
// on a VM one vCPU is often slower than the other for a while, and an even static split of the
// panels then waits for it at every GEMM's end.
struct PanelWork {
  int64_t m, block, run, runs, items;
  PanelWork(int64_t m, int64_t k, int64_t count, int64_t element_size, int64_t threads)
      : m(m), block(row_block(k, element_size, kTileRows)) {
    run = std::max<int64_t>(1, count / (8 * std::max<int64_t>(1, threads)));  // ~8 items per thread
    runs = (count + run - 1) / run;
    items = (m + block - 1) / block * runs;
  }
};

// Item `item` of `work`: its rows of x [m][k] times its panels into their columns of y [m][n]
// (rows ldy apart).
// Each panel prefetches the next one this thread multiplies: the item's next panel, or after its
// last the first panel of next_item (the item this thread has claimed next; none: -1). The
// panel after an item's last in memory is usually the other thread's next: at decode sizes,
// where an item is a single panel of the attention and down projections, the prefetch was
// then wasted. Prefetching the thread's own next item made 64-row GEMMs over SmolLM2's shapes
// 5-15% faster (fp32) and 7-15% (bf16) on a 2-core EPYC Turin VM, 16-32 rows 15-30%; the
// offline fp32 workload 4% (9.66 -> 9.27 s).
template <typename In, typename T, typename Epilogue>
void multiply_item(const PanelWork& work, int64_t item, int64_t next_item, const In* x, int64_t k,
                   const T* packed, int64_t n, int64_t ldy, int64_t count, const float* bias, T* y,
                   const Epilogue& epilogue) {
  const int64_t row = item / work.runs * work.block, rows = std::min(work.block, work.m - row);
  const int64_t first = item % work.runs * work.run, last = std::min(count, first + work.run);
  const T* after_last = next_item < 0 ? nullptr : packed + next_item % work.runs * work.run * k * kCols;
  for (int64_t panel = first; panel < last; ++panel) {
    const T* next = panel + 1 < last ? packed + (panel + 1) * k * kCols : after_last;
    multiply_panel(x + row * k, rows, k, packed, n, ldy, panel, bias, y + row * ldy, next, epilogue);
  }
}

#endif

}  // namespace tessera::panels
