"""The router's block hashes are the engine's: the same chain over the same blocks, salted alike."""

from __future__ import annotations

import pytest

from tessera.core.kv_cache_manager import KVCacheManager
from tessera.core.request import Request
from tessera.router.prompt_hashes import block_hashes
from tessera.sampling_params import SamplingParams


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("num_tokens", [15, 16, 17, 48, 50])
def test_the_routers_hashes_are_the_blocks_the_engine_can_hit(salt: str | None, num_tokens: int) -> None:
    tokens = [(7 * i + 3) % 500 for i in range(num_tokens)]
    request = Request("r", tokens, SamplingParams(max_tokens=4), eos_token_id=None, cache_salt=salt)
    manager = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=True)
    manager.get_computed_blocks(request)  # the engine hashes the request's full blocks
    hittable = (num_tokens - 1) // 16  # the engine never hits the block holding the last token
    assert block_hashes(tokens, 16, salt) == request.block_hashes[:hittable]
    assert block_hashes(tokens, 16, salt) != block_hashes(tokens, 16, "other") or hittable == 0
