// Dropping a weight from every cache level, so that the GEMM selection times each candidate as a
// decode step meets it: in memory.
#include <cstdint>

#include "ops.h"
#include "simd.h"

namespace tessera {

// Writes back and drops [address, address + bytes) from every cache level; whether it could
// here. The GEMM selection times each candidate on a weight evicted so: a decode step streams
// every layer's weights, far more than the caches hold, so each GEMM meets its weight in memory.
// On the Xeon with AMX, timed hot, MKL beat the panels on SmolLM2's QKV and O shapes by 1-2%;
// evicted, the panels won both (64 rows: 300 against 374 us, 180 against 248; MKL's packed
// buffers are 2-5x the weights' size).
bool evict_from_caches(int64_t address, int64_t bytes) {
#if defined(__x86_64__) || defined(__aarch64__)
  const char* begin = reinterpret_cast<const char*>(address);
  for (int64_t offset = 0; offset < bytes; offset += kCacheLine) {
#if defined(__CLFLUSHOPT__)
    __builtin_ia32_clflushopt(begin + offset);  // unordered among themselves: several in flight
#elif defined(__x86_64__)
    __builtin_ia32_clflush(begin + offset);
#else
    asm volatile("dc civac, %0" : : "r"(begin + offset) : "memory");
#endif
  }
#if defined(__x86_64__)
  __builtin_ia32_mfence();
#else
  asm volatile("dsb ish" : : : "memory");
#endif
  return true;
#else
  (void)address;
  (void)bytes;
  return false;
#endif
}

}  // namespace tessera
