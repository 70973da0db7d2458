"""How many KV blocks every rank gets: the one place that decides (vLLM's split).

The ranks measure (``worker/memory_profile.py``: their cache's shape, and on a GPU a profiled
step of the largest batch); this module decides: the batch that is profiled, the bytes of one
block, each rank's memory budget, the block count (as many as the smallest rank can hold) and
the check that one sequence of ``max_model_len`` fits. ``Executor.initialize_kv_cache`` runs
the steps on the ranks.
"""

from __future__ import annotations

from tessera.config import EngineConfig
from tessera.sampling_params import SamplingParams
from tessera.wire.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from tessera.worker.memory_profile import KVCacheFacts, MemoryProfile

PROFILE_REQUEST_PREFIX = "tessera-memory-profile-"
# The torch attention path gathers a decode batch's context of one layer at a time into a
# workspace that grows by a quarter: at most this share of one layer's cache beyond the cache.
DECODE_WORKSPACE_SHARE = 1.25
# A CPU rank's cache when no size is given (CPU ranks are not profiled).
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def profile_batch(config: EngineConfig, max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The largest batch one step can carry, as the scheduler makes it of that many fresh
    prompts (tests/core checks that it does), and the blocks it needs: max_num_batched_tokens
    prompt tokens over up to max_num_seqs requests, every prompt whole, each sampled."""
    budget = config.max_num_batched_tokens
    count = max(1, min(config.max_num_seqs, budget))
    length = max(1, min(budget // count, max_model_len - 1))  # every prompt whole: each is sampled
    blocks_each = -(-length // config.block_size)
    num_blocks = count * -(-(length + 1) // config.block_size)  # room for the sampled token too
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    batch = SchedulerOutput(num_scheduled_tokens=count * length)
    for index in range(count):
        request_id = f"{PROFILE_REQUEST_PREFIX}{index}"
        prompt = [0] * length
        batch.scheduled.append(
            ScheduledRequest(
                request_id=request_id,
                token_ids=list(prompt),
                start_position=0,
                block_ids=list(range(index * blocks_each, (index + 1) * blocks_each)),
                sample=True,
                new=NewRequestData(prompt, [], params, None),
            )
        )
        batch.incarnations[request_id] = index
    return batch, num_blocks


def bytes_per_block(facts: KVCacheFacts, block_size: int) -> int:
    """One block of every layer this rank holds, K and V."""
    return 2 * facts.num_layers * block_size * facts.num_kv_heads * facts.head_dim * facts.element_size


def kv_cache_budget(profile: MemoryProfile, total: int, utilization: float, num_layers: int) -> int:
    """Bytes for a GPU rank's KV cache: the device's share less the weights, a step's peak and
    the memory torch does not hold, and less the decode workspace that grows with the cache
    itself (one layer's share of it)."""
    left = int(total * utilization) - profile.weights - profile.step_peak - profile.outside_torch
    return max(0, int(left / (1 + DECODE_WORKSPACE_SHARE / num_layers)))


def rank_budget(config: EngineConfig, facts: KVCacheFacts) -> int:
    """Bytes one rank gives its cache: the size given, else what its profile left (GPU), else
    the CPU default."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if not facts.on_gpu:
        return DEFAULT_CPU_KV_CACHE_BYTES
    if facts.profile is None or facts.device_total is None:
        raise RuntimeError("a GPU rank sizes its KV cache after a memory profile (none was run)")
    return kv_cache_budget(facts.profile, facts.device_total, config.gpu_memory_utilization, facts.num_layers)


def decide_num_blocks(config: EngineConfig, ranks: list[KVCacheFacts], max_model_len: int) -> int:
    """Every rank's block count: the one given, else as many as the smallest rank can hold;
    ValueError when that is too few for one sequence of max_model_len tokens."""
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    else:
        num_blocks = min(
            max(rank_budget(config, facts) // bytes_per_block(facts, config.block_size), 0) for facts in ranks
        )
    block_size = config.block_size
    if num_blocks < -(-max_model_len // block_size):
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), fewer than max_model_len={max_model_len}: "
            "raise kv_cache_memory / num_kv_blocks (or gpu_memory_utilization) or lower max_model_len"
        )
    return num_blocks
