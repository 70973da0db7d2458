"""A GPU rank's KV cache, sized as vLLM sizes it: what `gpu_memory_utilization` of the device
leaves after the weights, the peak a step allocates on top of them, and the memory torch does
not hold (the CUDA context, NCCL's buffers).

The peak is measured, not guessed: before the cache exists, every rank runs one step of the
largest batch the scheduler can make (max_num_batched_tokens prompt tokens over up to
max_num_seqs requests, each sampled) on a cache just big enough for it. Free memory read after
loading the weights alone would leave no room for that step: the first large batch would run
out of memory. CPU ranks take a fixed budget (kv_cache_memory) and are not profiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from tessera.config import EngineConfig
from tessera.core.request import Request
from tessera.core.scheduler import Scheduler
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import EngineCoreRequest
from tessera.wire.sched_output import SchedulerOutput

PROFILE_REQUEST_PREFIX = "tessera-memory-profile-"
# The torch attention path gathers a decode batch's context of one layer at a time into a
# workspace that grows by a quarter: at most this share of one layer's cache beyond the cache.
DECODE_WORKSPACE_SHARE = 1.25


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


def kv_cache_budget(profile: MemoryProfile, total: int, utilization: float, num_layers: int) -> int:
    """Bytes for the KV cache: the device's share less the rest, and less the decode workspace
    that grows with the cache itself (one layer's share of it)."""
    left = int(total * utilization) - profile.weights - profile.step_peak - profile.outside_torch
    return max(0, int(left / (1 + DECODE_WORKSPACE_SHARE / num_layers)))


def profile_batch(config: EngineConfig, max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The largest batch one step can carry, as the scheduler makes it, and the blocks it needs."""
    budget = config.max_num_batched_tokens
    count = max(1, min(config.max_num_seqs, budget))
    length = max(1, min(budget // count, max_model_len - 1))  # every prompt whole: each is sampled
    num_blocks = count * -(-(length + 1) // config.block_size)
    # No prefix caching (the prompts are all alike and must all be computed), no chunk cap.
    settings = {"enable_prefix_caching": False, "long_prefill_token_threshold": 0}
    scheduler = Scheduler(config.model_copy(update=settings), num_blocks, max_model_len)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for index in range(count):
        request = EngineCoreRequest(
            f"{PROFILE_REQUEST_PREFIX}{index}", [0] * length, params, None, time.time()
        )
        scheduler.add_request(Request.from_engine_core_request(request))
    return scheduler.schedule(), num_blocks
