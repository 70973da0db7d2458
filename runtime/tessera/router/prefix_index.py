"""Which endpoints recently served a prompt holding each KV block: the router's guess of where
a prompt's prefix is cached, without asking the leaders.

Bounded by entries (one per block hash), least recently used first out. An entry is a 32-byte
SHA-256 digest (a 65-byte bytes object), a tuple of up to `endpoints_per_block` references to
endpoint strings the router holds anyway (48 bytes for one, 8 more each) and the ordered dict's
slot and link (about 75 bytes): about 190 bytes with one endpoint (200 with two), measured in
tests/router/test_prefix_index.py; 100 000 entries (the default: 1.6 M prompt tokens at
16-token blocks) take about 19 MB.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tessera.router.lru import BoundedLRU

DEFAULT_ENDPOINTS_PER_BLOCK = 4  # replicas remembered per block: more is rarely worth a hit


class PrefixIndex:
    def __init__(self, max_entries: int, endpoints_per_block: int = DEFAULT_ENDPOINTS_PER_BLOCK) -> None:
        self._blocks: BoundedLRU[bytes, tuple[str, ...]] = BoundedLRU(max_entries)
        self.endpoints_per_block = endpoints_per_block

    def __len__(self) -> int:
        return len(self._blocks)

    def matched_blocks(self, block_hashes: Sequence[bytes], endpoints: Iterable[str]) -> dict[str, int]:
        """For each endpoint, how many of the prompt's leading blocks it served: the hashes are
        chained, so a prefix cache holds a run from the first block, never a later block alone."""
        matched = dict.fromkeys(endpoints, 0)
        alive = set(matched)
        for block_hash in block_hashes:
            holders = self._blocks.get(block_hash)
            if holders is None:
                break
            alive.intersection_update(holders)
            if not alive:
                break
            for endpoint in alive:
                matched[endpoint] += 1
        return matched

    def record(self, block_hashes: Sequence[bytes], endpoint: str) -> None:
        """The endpoint now holds these blocks (it was sent the prompt): the most recent holder."""
        for block_hash in block_hashes:
            holders = self._blocks.get(block_hash) or ()
            if holders and holders[-1] == endpoint:
                self._blocks.put(block_hash, holders)
                continue
            kept = tuple(e for e in holders if e != endpoint)[-(self.endpoints_per_block - 1) :]
            self._blocks.put(block_hash, (*kept, endpoint) if self.endpoints_per_block > 1 else (endpoint,))
