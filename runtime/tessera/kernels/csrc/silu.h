// SiLU, on a float and on a vector of floats: silu_and_mul's loops and the GEMMs' SwiGLU
// epilogues compute it the same way, so the fused GEMM gives the unfused pass's bits.
#pragma once

#include <cmath>

#include "simd.h"

namespace tessera {

// g * sigmoid(g), with exp of a non-positive argument only: sigmoid is stable for both signs.
inline float silu(float g) {
  const float e = exp_approx(-std::fabs(g));
  const float sigmoid = g >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
  return g * sigmoid;
}

// silu(g) * u on lanes holding values of T's precision (the gate_up projection's outputs).
template <typename T>
inline fvec silu_mul(fvec g, fvec u) {
  const fvec e = expv(g < -g ? g : -g);  // exp of a non-positive argument only: stable for both signs
  const fvec sigmoid = (g >= 0.0f ? broadcastv(1.0f) : e) / (1.0f + e);
  return roundv_to<T>(g * sigmoid) * u;
}

}  // namespace tessera
