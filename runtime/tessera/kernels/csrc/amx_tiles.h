// Intel AMX's tile state: whether this build has AMX (TESSERA_AMX), the process's permission to
// use the tiles, each thread's tile configuration, and the store of fp32 lanes as bf16 that the
// AMX GEMM (amx_gemm.h) and AMX attention (amx_attention.h) both end in.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace tessera::amx {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TESSERA_AMX 1
#endif

constexpr int64_t kTileRows = 16;  // rows of every tile; an fp32 tile's columns too

#if defined(TESSERA_AMX)

// The process may use the tile registers once Linux has granted it the state (arch_prctl).
inline bool request_tile_state() {
  constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Per thread: eight tiles of 16 rows x 64 bytes (the GEMM's: 0-3 the sums, 4-5 rows of x, 6-7 the
// panel's two B tiles).
inline void configure_tiles() {
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = kTileRows;
  }
  // Not _tile_loadconfig: GCC's declares that it reads 8 bytes, so the stores that zero the rest
  // may be dropped, and a garbage row count in an unused tile faults (seen in a test program at -O3).
  asm volatile("ldtilecfg %0" : : "m"(config));
}

// fp32 lanes -> bf16 words, rounded to nearest even by the hardware (vcvtneps2bf16: simd.h's
// bf16_bits in one instruction); live lanes of 16 stored at y.
inline void store_bf16(uint16_t* y, __m512 values, int64_t live) {
  const __mmask16 mask = live >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(values)));
}

#endif

}  // namespace tessera::amx
