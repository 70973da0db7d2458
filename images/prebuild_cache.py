"""Bakes into $TESSERA_CACHE what every rank would otherwise build or measure on its first start.

The model aliases' conversions (models/), the CPU kernels (kernels/, keyed on the CPU's flags:
a node with other instruction sets compiles its own) and, beside them, the GEMM backend of each
weight shape a rank of those models holds (gemm_selection's verdicts, `tessera kernels` lists
them) at every tensor-parallel size up to 8 that the model splits over, in fp32 and bf16, with
one thread (rank pods run OMP_NUM_THREADS=1 where they share a node's cores) and with all of
this machine's: measured here, alone, instead of by rank pods that start together and time each
other's loading. The runtime image runs it at build time with TESSERA_CACHE=/opt/tessera/cache,
which the runtime reads as its prebuilt cache; `make demo` runs it on the host, whose cache the
node agent mounts there. A second run finds everything recorded and takes seconds.
"""

import os
import time

import torch

from tessera.kernels import cpu_kernels
from tessera.models.loader import select_gemm_backends
from tessera.models.registry import ALIASES, resolve_model

MAX_TP_SIZE = 8

kernels = cpu_kernels()
print(f"CPU kernels: {kernels or 'unavailable (no compiler): ATen ops will be used'}")
for alias in ALIASES:
    folder = resolve_model(alias)
    print(f"{alias}: {folder}")
    if kernels is None:
        continue
    started = time.monotonic()
    for threads in sorted({1, len(os.sched_getaffinity(0))}):
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            for tp_size in range(1, MAX_TP_SIZE + 1):
                try:
                    backends = select_gemm_backends(folder, dtype=dtype, tp_size=tp_size)
                except ValueError:
                    continue  # the model does not split over tp_size
                print(f"  {threads} thread(s), {str(dtype)[6:]}, TP {tp_size}: {backends}")
    print(f"  GEMM verdicts ready in {time.monotonic() - started:.1f} s")
