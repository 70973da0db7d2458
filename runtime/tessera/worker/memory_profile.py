"""What a rank measures for its KV cache; ``executor/kv_sizing.py`` decides the size from it.

A GPU rank's cache is sized as vLLM sizes it: what `gpu_memory_utilization` of the device
leaves after the weights, the peak a step allocates on top of them, and the memory torch does
not hold (the CUDA context, NCCL's buffers). The peak is measured, not guessed: before the
cache exists, every rank runs one step of the largest batch the scheduler can make on a cache
just big enough for it. Free memory read after loading the weights alone would leave no room
for that step: the first large batch would run out of memory. CPU ranks take a fixed budget
(kv_cache_memory) and are not profiled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class DeviceMemory(Protocol):
    """The few numbers the sizing reads (torch.cuda's; a test may stand in for them)."""

    def reset_peak(self) -> None: ...
    def allocated(self) -> int: ...  # bytes torch's tensors hold now
    def peak(self) -> int: ...  # the most they held since reset_peak
    def reserved(self) -> int: ...  # bytes torch's caching allocator holds from the device
    def free_and_total(self) -> tuple[int, int]: ...
    def release_cached(self) -> None: ...


@dataclass
class CudaMemory:
    device: torch.device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))

    def free_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass
class MemoryProfile:
    weights: int  # bytes torch holds once the profile's cache is freed: the model
    step_peak: int  # bytes a step allocated on top of the weights and the profile's cache
    outside_torch: int  # bytes used on the device that torch's allocator does not hold


@dataclass(frozen=True)
class KVCacheFacts:
    """What one rank tells the sizing: its cache's shape and, on a GPU, its profile. Builtins
    only: it crosses the rank channel as a dict (``KVCacheFacts(**facts)`` rebuilds it)."""

    num_layers: int  # this rank's layers (its pipeline stage's)
    num_kv_heads: int  # this rank's share of them (tensor parallelism)
    head_dim: int
    element_size: int  # bytes of one cache element
    on_gpu: bool
    device_total: int | None = None  # a GPU's memory
    weights: int | None = None  # the MemoryProfile, once one ran
    step_peak: int | None = None
    outside_torch: int | None = None

    @property
    def profile(self) -> MemoryProfile | None:
        if self.weights is None or self.step_peak is None or self.outside_torch is None:
            return None
        return MemoryProfile(self.weights, self.step_peak, self.outside_torch)
