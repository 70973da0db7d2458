// Which weight row each column of a packed panel multiplies, for panels of Cols columns (-1:
// none, a zero column): shared by the vector panels (panel_gemm.h) and the AMX panels
// (amx_gemm.h), which differ only in their width.
#pragma once

#include <cstdint>

namespace tessera {

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

}  // namespace tessera
