// The vocabulary every kernel computes in: fp32 lanes (GCC vector extensions), their loads and
// stores from fp32 and bf16, bf16 rounding, exp, and the in-register shuffles (folds,
// transposes, horizontal max and sum). Free of torch.
//
// kLanes is one for the whole build: 16 lanes where AVX-512 runs each vector as one
// instruction, 8 on AVX2 (whose 16 ymm registers 16-lane code would spill all the time) and
// below. The panel GEMM's vectors (panel_gemm.h) are the same width.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <limits>
#include <type_traits>

namespace tessera {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kCacheLine = 64;

// ---- element conversions -----------------------------------------------------------------------
//
// The kernels compute in fp32 whatever the tensors hold. A 16-bit type the build marks as bf16
// (IsBf16, specialised where torch's type is known) converts with plain bit operations, which
// `omp simd` loops and vector code compile to shifts: c10's conversion operators did not
// vectorise, and bf16 attention and SiLU ran slower than fp32 on half the bytes.

template <typename T>
struct IsBf16 : std::false_type {};

template <typename T>
inline float to_float(T x) {
  if constexpr (IsBf16<T>::value) {
    uint16_t half;
    std::memcpy(&half, &x, sizeof(half));
    const uint32_t bits = static_cast<uint32_t>(half) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(x);
  }
}

// 32-bit lanes as wide as Floats: uint32_t for a float, a vector of them for a vector of floats.
template <typename Floats>
struct LaneBits {
  typedef uint32_t type __attribute__((vector_size(sizeof(Floats))));
};
template <>
struct LaneBits<float> {
  using type = uint32_t;
};

// The bf16 nearest to f, ties to even, NaN a quiet NaN (the rounding torch's own bf16 casts do),
// for a float or a vector of floats (fvec, __m256, __m512): the one bf16 rounding of these
// kernels, every narrowing goes through it. Each 32-bit lane holds the bf16's bits in its high
// half (kHighHalf: the fp32 value it rounds to) or in its low half. The two are one rounding
// placed where each caller wants it: a shift of the other placement cost the fused SwiGLU
// epilogues extra instructions (GCC does not move it through the NaN select).
template <bool kHighHalf, typename Floats>
inline typename LaneBits<Floats>::type bf16_rounded(Floats f) {
  using Bits = typename LaneBits<Floats>::type;
  Bits bits;
  if constexpr (std::is_same_v<Floats, float>)
    std::memcpy(&bits, &f, sizeof(bits));
  else
    bits = reinterpret_cast<Bits>(f);
  const Bits nearest = bits + 0x7FFFu + ((bits >> 16) & 1u);
  if constexpr (kHighHalf)
    return f != f ? Bits{} + 0x7FC00000u : nearest & 0xFFFF0000u;
  else
    return f != f ? Bits{} + 0x7FC0u : nearest >> 16;
}

// The bf16 nearest to f, in the low half of each 32-bit lane.
template <typename Floats>
inline typename LaneBits<Floats>::type bf16_bits(Floats f) {
  return bf16_rounded<false>(f);
}

template <typename T>
inline T from_float(float f) {
  if constexpr (IsBf16<T>::value) {
    const uint16_t half = static_cast<uint16_t>(bf16_bits(f));
    T x;
    std::memcpy(&x, &half, sizeof(x));
    return x;
  } else {
    return static_cast<T>(f);
  }
}

// x rounded to T's precision, kept in fp32 (the reference rounds its intermediates so).
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// e^f for |f| <= ln2/2: degree-6 Taylor polynomial, on a float or on a vector of floats.
template <typename V>
inline V exp_fraction(V f) {
  V p = f * 0.0f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  return p * f + 1.0f;
}

// exp for x <= 0 (softmax after max subtraction; SiLU of either sign is handled by the caller):
// 2^round(x*log2 e) * 2^f with |f| <= 1/2 and a degree-6 Taylor polynomial (relative error
// ~1e-7, below fp32 resolution). Written so `omp simd` loops vectorise it.
inline float exp_approx(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  // Round to nearest by the 1.5 * 2^23 trick: plain arithmetic, so the loop vectorises.
  const float n = (t + 12582912.0f) - 12582912.0f;
  const float p = exp_fraction((t - n) * 0.6931471805599453f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// ---- vectors of kLanes floats ------------------------------------------------------------------

#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
constexpr int kVectorRegisters = 32;
#else
constexpr int64_t kLanes = 8;
constexpr int kVectorRegisters = 16;
#endif

typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef int32_t ivec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

// kLanes elements of a type the fast paths take (fp32, bf16), as fp32 lanes: bf16 widens in
// registers (zero-extend, shift), so a cache block is read once and never staged.
template <typename T>
inline fvec loadv_as_float(const T* p) {
  static_assert(std::is_same_v<T, float> || IsBf16<T>::value, "fp32 or bf16");
  if constexpr (std::is_same_v<T, float>) {
    return loadv(p);
  } else {
#ifdef __AVX512F__
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return reinterpret_cast<fvec>(_mm512_slli_epi32(wide, 16));
#else
    hvec half;
    std::memcpy(&half, p, sizeof(half));
    return reinterpret_cast<fvec>(__builtin_convertvector(half, ivec) << 16);
#endif
  }
}

inline fvec broadcastv(float x) { return fvec{} + x; }

// round_to on a vector: v rounded to T's precision (fp32 or bf16), kept in fp32 lanes.
template <typename T>
inline fvec roundv_to(fvec v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    static_assert(IsBf16<T>::value, "fp32 or bf16");
    return reinterpret_cast<fvec>(bf16_rounded<true>(v));
  }
}

// from_float on a vector, stored: kLanes elements of T (fp32 or bf16) at p.
template <typename T>
inline void storev_as(T* p, fvec v) {
  if constexpr (std::is_same_v<T, float>) {
    storev(p, v);
  } else {
    const hvec half = __builtin_convertvector(bf16_rounded<true>(v) >> 16, hvec);
    std::memcpy(p, &half, sizeof(half));
  }
}

// 0, 1, ..., kLanes - 1.
inline ivec lane_indices() {
  ivec lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  return lane;
}

// The shuffles below take their level (S, kWidth) as a template argument, so each mask is a
// constant and compiles to a shuffle instruction or two. With the level a loop variable, GCC
// built the masks at run time (an integer division per lane for fold): on an EPYC Milan that was
// most of a decode's attention time. Inlined always, since a call would store the vectors.

// Halves a and b into one vector at tree level S: lanes of a's pairs of S-runs, then b's.
template <int S>
[[gnu::always_inline]] inline fvec fold(fvec a, fvec b) {
  ivec lo;
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) lo[l] = 2 * S * (l / S) + l % S;
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, lo + S);
}

template <int S>
[[gnu::always_inline]] inline void fold_level(fvec* p) {
#pragma GCC unroll 16
  for (int i = 0; i < S; ++i) p[i] = fold<S>(p[2 * i], p[2 * i + 1]);
  if constexpr (S > 1) fold_level<S / 2>(p);
}

// Lane j of the result = the sum of p[j]'s lanes (p holds kLanes vectors, and is clobbered).
[[gnu::always_inline]] inline fvec transpose_sum(fvec* p) {
  fold_level<kLanes / 2>(p);
  return p[0];
}

template <int kWidth>
[[gnu::always_inline]] inline fvec swap_lanes(fvec v) {
  ivec mask;
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) mask[i] = i ^ kWidth;
  return __builtin_shuffle(v, mask);
}

template <int kWidth = kLanes / 2>
[[gnu::always_inline]] inline float hmax(fvec v) {
  const fvec other = swap_lanes<kWidth>(v);
  v = v > other ? v : other;
  if constexpr (kWidth > 1) return hmax<kWidth / 2>(v);
  return v[0];
}

template <int kWidth = kLanes / 2>
[[gnu::always_inline]] inline float hsum(fvec v) {
  v += swap_lanes<kWidth>(v);
  if constexpr (kWidth > 1) return hsum<kWidth / 2>(v);
  return v[0];
}

// In place, m[r][l] becomes m[l][r] (kLanes vectors): rounds that swap ever smaller
// off-diagonal blocks.
template <int S = kLanes / 2>
[[gnu::always_inline]] inline void transpose_lanes(fvec* m) {
  ivec lo, hi;
#pragma GCC unroll 16
  for (int l = 0; l < kLanes; ++l) {
    lo[l] = (l & S) == 0 ? l : kLanes + l - S;
    hi[l] = (l & S) == 0 ? l + S : kLanes + l;
  }
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    if (i & S) continue;
    const fvec a = m[i], b = m[i + S];
    m[i] = __builtin_shuffle(a, b, lo);
    m[i + S] = __builtin_shuffle(a, b, hi);
  }
  if constexpr (S > 1) transpose_lanes<S / 2>(m);
}

// exp_approx on a vector.
inline fvec expv(fvec x) {
  const fvec floor = broadcastv(-87.0f);
  x = x > floor ? x : floor;
  const fvec t = x * 1.4426950408889634f;
  const fvec n = (t + 12582912.0f) - 12582912.0f;
  const fvec p = exp_fraction((t - n) * 0.6931471805599453f);
  const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace tessera
