// Tessera's bf16 GEMM on Intel AMX (Sapphire Rapids and later): y = x @ W^T through the tile
// matrix unit, with W packed once into panels of 32 output columns laid out as AMX's B tiles.
//
// A panel is K / 32 steps of two 16 x 64-byte B tiles (columns 0-15 and 16-31, each row one
// input pair of 16 columns: [16 pairs][16 columns][2]), 2 KB per step, read front to back. A
// block of 32 rows of x (two A tiles, 16 rows x 32 inputs each) times one panel accumulates into
// four fp32 tiles (rows 0-15 / 16-31 x columns 0-15 / 16-31); the epilogue turns each row of sums
// into outputs. Every weight is read from memory once per block of rows.
//
// Why: at decode a step streams every weight of the model once; AMX does a 16x16x32 product per
// instruction, so the multiply hides behind the stream and what is left is reading the panels.
// Measured on a 2-vCPU Xeon with AMX (SmolLM2's 30 layers of shapes, weights cold, bf16), against
// oneDNN's prepacked AMX kernels: 64 rows 12.6 ms per pass over the layers against 17.1 (16.9
// against 12.4 GB/s of weights), 8 rows 11.0 against 12.4 ms, 512 rows 1.84 against 1.66 TFLOP/s;
// a call costs about 5 us against oneDNN's 18 (121 calls a step). The vdpbf16ps panels
// (panel_gemm.h) reached 0.2 TFLOP/s at 64 rows there.
//
// K is padded to whole steps with zero weights (x with zero inputs), M to whole 32-row groups (a
// short last group is read from a zero-padded copy of its rows); sums run in fp32 and outputs
// round to nearest even.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "panel_layout.h"

namespace tessera::amx {

constexpr int64_t kStep = 32;                 // bf16 inputs per A tile row (64 bytes)
constexpr int64_t kCols = 2 * kTileRows;      // output columns of a plain panel: two B tiles
constexpr int64_t kStepWords = kCols * kStep;  // bf16 words of a panel per step (2 KB)

inline int64_t padded_k(int64_t k) { return (k + kStep - 1) / kStep * kStep; }
inline int64_t panel_count(int64_t n) { return (n + kCols - 1) / kCols; }
// Gated panels hold the gate and the up rows of the same 16 outputs.
inline int64_t gated_panel_count(int64_t width) { return (width + kTileRows - 1) / kTileRows; }

// Plain panels of 32 weight rows; gated ones hold the gate and the up rows of the same 16
// outputs, so a row of sums holds both factors of its outputs.
using PlainRows = PlainPanelRows<kCols>;
using GatedRows = GatedPanelRows<kCols>;

// The AMX panels' layout (panel_layout.h's pack_panel) of bf16 words: K padded to whole steps;
// input i of column col at step i / 32, tile col / 16, pair row (i % 32) / 2, [col % 16][i % 2].
struct Layout {
  static constexpr int64_t kCols = amx::kCols;
  static int64_t padded_k(int64_t k) { return amx::padded_k(k); }
  static int64_t offset(int64_t i, int64_t col) {
    const int64_t tile = col / kTileRows, column = col % kTileRows, pair = (i % kStep) / 2;
    return (i / kStep) * kStepWords + (tile * kTileRows + pair) * kCols + column * 2 + i % 2;
  }
};

// A multiplication's work items: a block of rows times a run of panels, row blocks outermost;
// one run per thread, so that at decode each thread streams one contiguous range of panels
// (measured 5-15% faster at 64 rows than two or eight runs per thread, taken dynamically;
// prefetching the next panel in software was no faster either).
struct Work {
  int64_t m, block, run, runs, items;
  Work(int64_t m, int64_t k, int64_t count, int64_t threads) : m(m), block(row_block(k, 2, 2 * kTileRows)) {
    threads = std::max<int64_t>(1, threads);
    run = (count + threads - 1) / threads;
    runs = (count + run - 1) / run;
    items = (m + block - 1) / block * runs;
  }
};

#if defined(TESSERA_AMX)

// The epilogue of the 32-row group before the current one, run a few rows at a time between the
// current group's tile products: the core turns sums into outputs while the tile unit
// multiplies, instead of the tile unit idling through every epilogue (a tile store waits for
// the products, and the epilogue for the store). On a 2-vCPU Xeon with AMX, alternating builds,
// 2048 rows of SmolLM2's shapes: gate_up with the SwiGLU epilogue 3.05-3.19 -> 2.54 ms,
// down 1.38 -> 1.13-1.21 ms (qkv and o level within noise); 30 layers at 16-64 rows 2-8% faster.
template <typename Epilogue>
struct PendingRows {
  const Epilogue& epilogue;
  int64_t ldy;                  // elements between output rows
  const float* sums = nullptr;  // the pending group's sums, [rows][32]
  uint16_t* y = nullptr;        // its first output row
  int64_t rows = 0, done = 0, live = 0;
  const float* bias = nullptr;

  // A group whose sums are ready: its epilogue is pending from now on.
  void hand_over(const float* group_sums, uint16_t* group_y, int64_t group_rows, int64_t group_live,
                 const float* group_bias) {
    sums = group_sums;
    y = group_y;
    rows = group_rows;
    done = 0;
    live = group_live;
    bias = group_bias;
  }
  void run(int64_t count) {
    for (const int64_t end = std::min(rows, done + count); done < end; ++done)
      epilogue(y + done * ldy, sums + done * kCols, live, bias);
  }
  void finish() { run(rows); }
};

// Rows [0, 16 * Blocks) of x (k_padded inputs a row) times one panel: sums [16 * Blocks][32],
// with the pending rows' epilogue spread over the steps.
// x's tiles load with the streaming hint (tileloaddt1): a panel serves every 32 rows of the block
// and stays in L1, while the rows pass through once per panel and would evict it. On a 2-vCPU
// Xeon with AMX, 30 layers of SmolLM2's shapes: 2048 rows 2.15 -> 2.5 TFLOP/s, 512 rows +9%,
// 64 rows +3%. (Prefetching the panels in software, a step or a panel ahead, gained nothing.)
template <int Blocks, typename Pending>
inline void panel_sums(const uint16_t* x, int64_t k_padded, const uint16_t* panel, float* sums, Pending& pending) {
  static_assert(Blocks == 1 || Blocks == 2);
  const int64_t stride = k_padded * 2, steps = k_padded / kStep;
  const int64_t rows_per_step = (pending.rows - pending.done + steps - 1) / steps;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Blocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t step = 0; step < steps; ++step) {
    const uint16_t* weights = panel + step * kStepWords;
    _tile_stream_loadd(4, x + step * kStep, stride);
    _tile_loadd(6, weights, 64);
    _tile_loadd(7, weights + kStepWords / 2, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (Blocks == 2) {
      _tile_stream_loadd(5, x + kTileRows * k_padded + step * kStep, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    pending.run(rows_per_step);
  }
  pending.finish();  // the caller hands over this group next
  constexpr int64_t ld = kCols * sizeof(float);
  _tile_stored(0, sums, ld);
  _tile_stored(1, sums + kTileRows, ld);
  if constexpr (Blocks == 2) {
    _tile_stored(2, sums + kTileRows * kCols, ld);
    _tile_stored(3, sums + kTileRows * kCols + kTileRows, ld);
  }
}

// The plain epilogue: a row's 32 sums (plus the panel's fp32 bias) are its outputs.
struct StoreRow {
  static constexpr int64_t kOutCols = kCols;
  void operator()(uint16_t* y, const float* sums, int64_t live, const float* bias) const {
    __m512 low = _mm512_loadu_ps(sums), high = _mm512_loadu_ps(sums + 16);
    if (bias != nullptr) {  // a short panel's bias reads only its real columns
      const int64_t high_live = std::clamp<int64_t>(live - 16, 0, 16);
      low = _mm512_add_ps(low, _mm512_maskz_loadu_ps(live >= 16 ? 0xFFFF : (1u << live) - 1, bias));
      high = _mm512_add_ps(high, _mm512_maskz_loadu_ps(high_live == 16 ? 0xFFFF : (1u << high_live) - 1, bias + 16));
    }
    store_bf16(y, low, live);
    if (live > 16) store_bf16(y + 16, high, live - 16);
  }
};

// The rows of x as the tiles read them: [m][k_padded], except that the last 32-row group, when
// it is short, is read from a copy padded with zero rows (tail), so that x itself is not copied
// to pad its rows: 30 layers of SmolLM2's shapes at 1777 rows took 191 ms with the whole copy,
// 154 without (2048 rows: 174).
struct Rows {
  const uint16_t* x;
  int64_t k_padded;
  const uint16_t* tail = nullptr;  // rows [tail_row, tail_row + 32) of x, zero past its end
  int64_t tail_row = -1;
  const uint16_t* at(int64_t row) const { return row == tail_row ? tail : x + row * k_padded; }
};

// Item `item` of `work`: its rows of x times its panels into their columns of y [m][n]; bias is
// the whole fp32 bias [n] (plain panels) or null.
template <typename Epilogue>
void multiply_item(const Work& work, int64_t item, const Rows& x, int64_t k_padded, const uint16_t* packed,
                   int64_t n, int64_t count, const float* bias, uint16_t* y, const Epilogue& epilogue) {
  alignas(64) float sums[2][2 * kTileRows * kCols];  // this group's and the pending group's
  constexpr int64_t out_cols = Epilogue::kOutCols;
  const int64_t first_row = item / work.runs * work.block;
  const int64_t end_row = std::min(work.m, first_row + work.block);
  const int64_t first = item % work.runs * work.run, last = std::min(count, first + work.run);
  PendingRows<Epilogue> pending{epilogue, n};
  int buffer = 0;
  for (int64_t panel = first; panel < last; ++panel) {
    const uint16_t* weights = packed + panel * k_padded * kCols;
    const int64_t live = std::min(out_cols, n - panel * out_cols);
    const float* panel_bias = bias == nullptr ? nullptr : bias + panel * out_cols;
    for (int64_t row = first_row; row < end_row; row += 2 * kTileRows) {
      const uint16_t* in = x.at(row);
      if (end_row - row > kTileRows)
        panel_sums<2>(in, k_padded, weights, sums[buffer], pending);
      else
        panel_sums<1>(in, k_padded, weights, sums[buffer], pending);
      pending.hand_over(sums[buffer], y + row * n + panel * out_cols, std::min(2 * kTileRows, end_row - row), live,
                        panel_bias);
      buffer ^= 1;
    }
  }
  pending.finish();
}

#endif

}  // namespace tessera::amx
