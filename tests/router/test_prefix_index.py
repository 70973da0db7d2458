"""The bounded prefix index: leading-run matches, recency, the bound, memory per entry."""

from __future__ import annotations

import hashlib
import tracemalloc

from tessera.router.prefix_index import PrefixIndex

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def hashes(n: int, seed: str = "x") -> list[bytes]:
    return [hashlib.sha256(f"{seed}{i}".encode()).digest() for i in range(n)]


def test_only_a_leading_run_of_blocks_matches() -> None:
    index = PrefixIndex(100)
    prompt = hashes(6)
    index.record(prompt[:4], A)
    index.record(prompt[:2], B)
    assert index.matched_blocks(prompt, [A, B, C]) == {A: 4, B: 2, C: 0}
    # A later block alone (its chain's first block unknown) is no match.
    index.record(prompt[3:], C)
    assert index.matched_blocks(prompt, [C]) == {C: 0}


def test_holders_per_block_are_bounded_most_recent_kept() -> None:
    index = PrefixIndex(100, endpoints_per_block=2)
    prompt = hashes(1)
    for endpoint in (A, B, C):
        index.record(prompt, endpoint)
    assert index.matched_blocks(prompt, [A, B, C]) == {A: 0, B: 1, C: 1}


def test_the_least_recently_used_block_leaves_first() -> None:
    index = PrefixIndex(4)
    first, second = hashes(3, "first"), hashes(3, "second")
    index.record(first, A)
    index.matched_blocks(first[:1], [A])  # a lookup makes the first block recent
    index.record(second, B)
    assert len(index) == 4
    assert index.matched_blocks(first, [A]) == {A: 1}  # its later blocks went
    assert index.matched_blocks(second, [B]) == {B: 3}


def test_an_entry_costs_about_190_bytes() -> None:
    """The figure prefix_index.py and docs/router.md give, measured (one endpoint per block)."""
    keys = hashes(20_000)  # the digests exist before: the router computes them per request anyway
    index = PrefixIndex(len(keys))
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index.record(keys, A)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    per_entry = (grown + 65 * len(keys)) / len(keys)  # + each digest, which the index keeps alive
    assert 150 < per_entry < 250, per_entry
