// Pinning the OpenMP threads (torch's, MKL's and these kernels') to CPUs.
#include <omp.h>
#include <sched.h>

#include <cstdint>
#include <vector>

#include "ops.h"

namespace tessera {

// Pins thread t of the OpenMP pool (the one torch, MKL and these kernels share; the caller is
// thread 0) to cpus[t]. libgomp keeps a team's threads for later regions of the same size, so
// the pinning lasts while torch's thread count stays len(cpus). Whether each pin took.
std::vector<bool> bind_threads(const std::vector<int64_t>& cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<char> pinned(n, 0);
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<int>(cpus[t]), &set);
    pinned[t] = omp_get_num_threads() == n && sched_setaffinity(0, sizeof(set), &set) == 0;
  }
  return std::vector<bool>(pinned.begin(), pinned.end());
}

}  // namespace tessera
