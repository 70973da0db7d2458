// How a weight [rows][k] is packed into panels of output columns, for both panel GEMMs: the
// vector panels (panel_gemm.h, 48 or 16 columns) and the AMX panels (amx_gemm.h, 32 columns as
// B tiles). Both are one algorithm: which weight row each of a panel's columns holds (plain or
// gated), and where each of its elements goes, which is all a Layout says. Also how many rows of
// x a pass over the panels takes, the same rule for both.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tessera {

// Which weight row each column of a packed panel multiplies (-1: none, a zero column).

// Plain: panel p's columns are rows [p * Cols, (p + 1) * Cols) of an [n][k] weight.
template <int64_t Cols>
struct PlainPanelRows {
  int64_t n;
  int64_t operator()(int64_t panel, int64_t col) const {
    const int64_t row = panel * Cols + col;
    return row < n ? row : -1;
  }
};

// Gated: a weight [2 * width][k] stacking gate over up (SwiGLU's gate_up projection). Panel p's
// first half holds gate rows [p * h, (p + 1) * h), its second half the same up rows (h = Cols /
// 2), so one tile holds both factors of output columns [p * h, (p + 1) * h).
template <int64_t Cols>
struct GatedPanelRows {
  int64_t width;
  int64_t operator()(int64_t panel, int64_t col) const {
    constexpr int64_t h = Cols / 2;
    const int64_t out = panel * h + col % h;
    return out >= width ? -1 : col < h ? out : width + out;
  }
};

// Panel `panel` of a row-major weight [rows][k] into out (Layout::padded_k(k) * Layout::kCols
// elements), its columns' rows given by row_of: input i of column col at Layout::offset(i, col),
// zero for a column without a row and for the inputs padding k.
template <typename Layout, typename T, typename RowOf>
void pack_panel(const T* weight, int64_t k, int64_t panel, const RowOf& row_of, T* out) {
  const int64_t depth = Layout::padded_k(k);
  for (int64_t col = 0; col < Layout::kCols; ++col) {
    const int64_t row = row_of(panel, col);
    for (int64_t i = 0; i < depth; ++i) out[Layout::offset(i, col)] = row >= 0 && i < k ? weight[row * k + i] : T(0);
  }
}

// Rows of x per pass over the panels, a multiple of `rows_multiple` (the kernel's row tile): a
// block of x small enough to stay in L2 while every panel passes by it. A prefill chunk's x
// (2048 rows x 1536 inputs: 12 MB) fits in no cache, and would be read from DRAM once per
// panel; the panels, read once per block instead, are megabytes, and stay in L3.
constexpr int64_t kRowBlockBytes = 256 * 1024;

inline int64_t row_block(int64_t k, int64_t element_size, int64_t rows_multiple) {
  const int64_t rows = kRowBlockBytes / std::max<int64_t>(1, k * element_size);
  return std::max(rows_multiple, rows / rows_multiple * rows_multiple);
}

}  // namespace tessera
