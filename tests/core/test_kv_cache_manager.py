"""Block pool and KV cache manager: reference counts, prefix hits, LRU eviction, freeing."""

import pytest

from tessera.core.block_pool import BlockPool
from tessera.core.kv_cache_manager import KVCacheManager
from tessera.core.request import Request
from tessera.sampling_params import SamplingParams


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), eos_token_id=None, cache_salt=cache_salt)


def test_free_queue_is_lru_and_tail_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4
    # The untouched block comes first, then the freed ones tail first.
    order = [pool.allocate(1)[0].block_id for _ in range(4)]
    assert order == [3, 2, 1, 0]


def test_allocate_refuses_without_side_effects():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    request = make_request("a", list(range(12)))  # needs 3 blocks
    assert not kv.allocate_slots(request, 12)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []


def test_prefix_hit_is_shared_and_capped_below_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(8)))
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 8)
    # Same 8 tokens: the last token must be computed, so only one block (4 tokens) hits.
    same = make_request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 4 and [b.block_id for b in hits] == kv.block_ids("a")[:1]
    # Longer prompt with the same 8-token prefix: both blocks hit.
    longer = make_request("c", [*list(range(8)), 99, 98])
    hits, num_hit = kv.get_computed_blocks(longer)
    assert num_hit == 8
    assert kv.allocate_slots(longer, 2, hits)
    assert kv.block_ids("c")[:2] == kv.block_ids("a")
    assert all(b.ref_cnt == 2 for b in hits)
    kv.free(first)
    kv.free(longer)
    assert kv.usage == 0.0


def test_a_cache_salt_shares_cached_blocks_only_with_the_same_salt():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    owner = make_request("a", prompt, cache_salt="tenant-a")
    assert kv.allocate_slots(owner, 9)
    kv.confirm_computed("a", 9)
    assert kv.get_computed_blocks(make_request("unsalted", prompt))[1] == 0
    assert kv.get_computed_blocks(make_request("other", prompt, cache_salt="tenant-b"))[1] == 0
    hits, num_hit = kv.get_computed_blocks(make_request("same", prompt, cache_salt="tenant-a"))
    assert num_hit == 8 and [b.block_id for b in hits] == kv.block_ids("a")[:2]
    # Unsalted requests share with each other as before.
    plain = make_request("p", prompt)
    assert kv.allocate_slots(plain, 9)
    kv.confirm_computed("p", 9)
    assert kv.get_computed_blocks(make_request("p2", prompt))[1] == 8


def test_freed_cached_blocks_are_reused_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = make_request("a", list(range(9)))
    assert kv.allocate_slots(first, 9)
    kv.confirm_computed("a", 9)  # the step that writes them ran
    kv.free(first)
    assert kv.usage == 0.0
    again = make_request("b", list(range(9)))
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 8
    # The hits sit on the free list: touching them is not free room, so asking for more than
    # what is left besides them fails cleanly.
    greedy = make_request("x", list(range(100, 108)))
    assert kv.allocate_slots(again, 1, hits)
    assert not kv.allocate_slots(greedy, 8)
    kv.free(again)
    # Filling the cache with other tokens evicts the old prefix.
    other = make_request("c", list(range(50, 66)))
    assert kv.allocate_slots(other, 16)
    kv.free(other)
    assert kv.get_computed_blocks(make_request("d", list(range(9))))[1] == 0


def test_double_free_is_caught():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError):
        pool.free(blocks)
