"""Which KV blocks each request holds: allocation, prefix-cache lookup, and freeing."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from tessera.core.block_pool import BlockPool, KVBlock
from tessera.core.request import Request

_ROOT_HASH = b"tessera-kv-root"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    """Chained, content-addressed block hash; stable across processes and pods (no PYTHONHASHSEED)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def root_hash(cache_salt: str | None) -> bytes:
    """The first block's parent: a salt makes a chain of its own, which every later block inherits."""
    if cache_salt is None:
        return _ROOT_HASH
    return hashlib.sha256(_ROOT_HASH + b"\0salt\0" + cache_salt.encode()).digest()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found

    def take(self) -> PrefixCacheStats:
        taken = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return taken


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}
        # Blocks registered in the prefix cache at schedule time, before the step that writes them
        # has run; only those below this count are known to be written. Freeing a request drops
        # the hashes of the rest, so a step that never ran (a request refused by the runner, an
        # interrupted offline run) cannot hand unwritten blocks to a later request.
        self.req_num_computed_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request) -> None:
        num_full = request.num_tokens // self.block_size
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for index in range(len(hashes), num_full):
            start = index * self.block_size
            parent = hash_block(parent, request.all_token_ids[start : start + self.block_size])
            hashes.append(parent)

    def _consults_cache(self, request: Request) -> bool:
        scoring_prompt = (
            request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent
        )
        return self.enable_prefix_caching and not scoring_prompt  # prompt logprobs need every position

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a request that holds no blocks yet: (blocks, tokens)."""
        if not self._consults_cache(request):
            return [], 0
        self._update_block_hashes(request)
        # The last token is always computed, so its logits exist: cap the hit at num_tokens - 1.
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup, if the cache was consulted (no data, not 0% hits, otherwise)."""
        if self._consults_cache(request):
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] | None = None
    ) -> bool:
        """Give a request room for num_new_tokens more tokens; False (nothing changed) if it does not fit."""
        computed = new_computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_needed = -(-total_tokens // self.block_size) - len(blocks) - len(computed)
        # Cache hits that sit on the free list leave it when touched: they are not free room.
        num_evictable_hits = sum(1 for block in computed if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return False
        self.pool.touch(computed)
        if computed:  # cache hits were written by whoever registered them
            self.req_num_computed_blocks[request.request_id] = len(blocks) + len(computed)
        blocks.extend(computed)
        if num_needed > 0:
            blocks.extend(self.pool.allocate(num_needed))
        self._cache_full_blocks(request, blocks, total_tokens)
        return True

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Register the blocks that will be full once this step's tokens are written."""
        if not self.enable_prefix_caching:
            return
        self._update_block_hashes(request)
        start = self.req_num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            self.pool.cache_block(blocks[index], request.block_hashes[index])
        self.req_num_cached_blocks[request.request_id] = max(start, end)

    def confirm_computed(self, request_id: str, num_tokens: int) -> None:
        """A step's output arrived: the request's first num_tokens tokens are in its blocks."""
        known = self.req_num_computed_blocks.get(request_id, 0)
        self.req_num_computed_blocks[request_id] = max(known, num_tokens // self.block_size)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        num_cached = self.req_num_cached_blocks.pop(request.request_id, 0)
        num_computed = self.req_num_computed_blocks.pop(request.request_id, 0)
        self.pool.uncache(blocks[num_computed:num_cached])
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
