"""The score rule (scorer.py): prefix hits win, load breaks them, a busy endpoint loses its
advantage, affinity only without a prefix signal, ties rotate."""

from __future__ import annotations

from tessera.router.scorer import AFFINITY, LOAD, PREFIX, EndpointLoad, ScoreWeights, choose

A, B = "http://a:1", "http://b:1"
W = ScoreWeights()


def test_a_prefix_hit_wins_over_a_little_more_load() -> None:
    loads = {A: EndpointLoad(inflight=2), B: EndpointLoad()}
    decision = choose([A, B], loads, {A: 8, B: 0}, 10, None, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (A, PREFIX)


def test_enough_load_outweighs_a_prefix_hit() -> None:
    loads = {A: EndpointLoad(inflight=5), B: EndpointLoad()}
    decision = choose([A, B], loads, {A: 10, B: 0}, 10, None, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, LOAD)


def test_a_busy_endpoint_loses_its_prefix_advantage() -> None:
    # Queue at the threshold: its hit counts for nothing; the other has a longer queue below it.
    loads = {A: EndpointLoad(waiting=W.busy_queue), B: EndpointLoad(waiting=W.busy_queue - 1)}
    decision = choose([A, B], loads, {A: 10, B: 0}, 10, None, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, LOAD)
    below = {A: EndpointLoad(waiting=W.busy_queue - 1), B: EndpointLoad(waiting=W.busy_queue - 1)}
    decision = choose([A, B], below, {A: 10, B: 0}, 10, None, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (A, PREFIX)


def test_kv_usage_counts_as_load() -> None:
    loads = {A: EndpointLoad(kv_usage=0.9), B: EndpointLoad(kv_usage=0.1)}
    decision = choose([A, B], loads, {}, 0, None, W)
    assert decision is not None and decision.endpoint == B


def test_affinity_is_the_fallback_without_a_prefix_signal() -> None:
    idle = {A: EndpointLoad(), B: EndpointLoad()}
    decision = choose([A, B], idle, {}, 0, B, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (B, AFFINITY)
    # A prefix hit anywhere switches affinity off.
    decision = choose([A, B], idle, {A: 1, B: 0}, 10, B, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (A, PREFIX)
    # A busy affine endpoint is not preferred.
    busy = {A: EndpointLoad(), B: EndpointLoad(waiting=W.busy_queue)}
    decision = choose([A, B], busy, {}, 0, B, W)
    assert decision is not None and (decision.endpoint, decision.reason) == (A, LOAD)


def test_ties_take_turns_and_no_endpoint_is_none() -> None:
    idle = {A: EndpointLoad(), B: EndpointLoad()}
    picked = set()
    for turn in range(4):
        decision = choose([A, B], idle, {}, 0, None, W, turn)
        assert decision is not None
        picked.add(decision.endpoint)
    assert picked == {A, B}
    assert choose([], idle, {}, 0, None, W) is None
