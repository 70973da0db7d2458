"""One place decides the KV block count from what the ranks measured (executor/kv_sizing.py)."""

from __future__ import annotations

import pytest

from tessera.config import EngineConfig
from tessera.executor.kv_sizing import DEFAULT_CPU_KV_CACHE_BYTES, bytes_per_block, decide_num_blocks
from tessera.worker.memory_profile import KVCacheFacts

GIB = 2**30
CPU_RANK = KVCacheFacts(num_layers=4, num_kv_heads=2, head_dim=16, element_size=4, on_gpu=False)


def test_a_block_holds_k_and_v_of_every_local_layer() -> None:
    assert bytes_per_block(CPU_RANK, block_size=16) == 2 * 4 * 16 * 2 * 16 * 4


def test_every_rank_gets_as_many_blocks_as_the_smallest_holds() -> None:
    config = EngineConfig(model="m", block_size=16)
    per_block = bytes_per_block(CPU_RANK, 16)
    assert decide_num_blocks(config, [CPU_RANK], 128) == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    bigger = KVCacheFacts(num_layers=8, num_kv_heads=2, head_dim=16, element_size=4, on_gpu=False)
    assert decide_num_blocks(config, [CPU_RANK, bigger], 128) == DEFAULT_CPU_KV_CACHE_BYTES // (2 * per_block)
    sized = config.model_copy(update={"kv_cache_memory": 64 * per_block})
    assert decide_num_blocks(sized, [CPU_RANK], 128) == 64
    given = config.model_copy(update={"num_kv_blocks": 9})
    assert decide_num_blocks(given, [CPU_RANK], 128) == 9


def test_too_few_blocks_for_one_sequence_and_a_gpu_rank_never_profiled_are_refused() -> None:
    config = EngineConfig(model="m", block_size=16, num_kv_blocks=7)
    with pytest.raises(
        ValueError, match=r"holds 7 blocks of 16 tokens \(112 tokens\), fewer than max_model_len=128"
    ):
        decide_num_blocks(config, [CPU_RANK], 128)
    gpu = KVCacheFacts(
        num_layers=4, num_kv_heads=2, head_dim=16, element_size=2, on_gpu=True, device_total=GIB
    )
    with pytest.raises(RuntimeError, match="none was run"):
        decide_num_blocks(EngineConfig(model="m"), [gpu], 128)
