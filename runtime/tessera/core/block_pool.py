"""Fixed-size KV blocks: reference counts, an LRU free list, and the prefix-cache index.

A freed block keeps its hash and contents until it is evicted, so a later request
with the same prefix can take it back. Free blocks are evicted from the head of
the LRU list; freeing appends to the tail.
"""

from __future__ import annotations

from collections.abc import Iterable


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: O(1) pop from the head, append, and remove from the middle."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        previous = self._head
        for block in blocks:
            previous.next_free, block.prev_free = block, previous
            previous = block
        previous.next_free, self._tail.prev_free = self._tail, previous

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not free"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; callers pass a request's blocks tail first so tails are evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:
            return  # an identical block is already cached; this copy stays uncached
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Forget these blocks' hashes: their contents cannot be trusted (never written)."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True
