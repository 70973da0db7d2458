"""The choice of an endpoint for one request: a score per Ready endpoint, the highest wins.

    score(e) = prefix_weight   * hit(e)
             + affinity_weight * affine(e)
             - load_weight     * (waiting(e) + inflight(e))
             - kv_weight       * kv_usage(e)

hit(e): the share of the prompt's full blocks e served last (0..1, PrefixIndex). affine(e): 1
when the request's session last went to e and no endpoint has a prefix hit (affinity is the
fallback when there is no prefix signal). waiting(e): e's queue (num_requests_waiting, polled);
inflight(e): the requests this router has open on e; kv_usage(e): 0..1 (kv_cache_usage_perc).
A busy endpoint (waiting(e) >= busy_queue) loses its prefix and affinity advantage: a cache hit
is not worth queueing behind a full waiting room. Equal scores take turns (round robin), so with
no signal at all requests spread evenly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PREFIX, AFFINITY, LOAD = "prefix", "affinity", "load"
REASONS = (PREFIX, AFFINITY, LOAD)


@dataclass(frozen=True)
class ScoreWeights:
    prefix: float = 4.0  # a whole-prompt hit is worth 4 requests queued ahead
    affinity: float = 2.0
    load: float = 1.0  # per request waiting or in flight
    kv: float = 2.0  # a full KV cache counts as 2 requests ahead
    busy_queue: int = 8  # waiting at or above this: the prefix and affinity advantage is lost


@dataclass(frozen=True)
class EndpointLoad:
    waiting: float = 0.0
    kv_usage: float = 0.0
    inflight: int = 0


@dataclass(frozen=True)
class Decision:
    endpoint: str
    reason: str  # one of REASONS: what made it win
    score: float


def choose(
    endpoints: Sequence[str],
    loads: Mapping[str, EndpointLoad],
    matched_blocks: Mapping[str, int],
    prompt_blocks: int,
    affinity: str | None,
    weights: ScoreWeights,
    turn: int = 0,
) -> Decision | None:
    """The best of ``endpoints`` (None when there is none); ``turn`` breaks ties in rotation."""
    if not endpoints:
        return None

    def is_busy(endpoint: str) -> bool:
        return loads.get(endpoint, EndpointLoad()).waiting >= weights.busy_queue

    hits = {
        e: 0.0 if prompt_blocks == 0 or is_busy(e) else matched_blocks.get(e, 0) / prompt_blocks
        for e in endpoints
    }
    any_hit = any(hit > 0 for hit in hits.values())
    affine = {e: float(not any_hit and e == affinity and not is_busy(e)) for e in endpoints}

    def score(endpoint: str) -> float:
        load = loads.get(endpoint, EndpointLoad())
        return (
            weights.prefix * hits[endpoint]
            + weights.affinity * affine[endpoint]
            - weights.load * (load.waiting + load.inflight)
            - weights.kv * load.kv_usage
        )

    scores = {e: score(e) for e in sorted(endpoints)}
    best_score = max(scores.values())
    best = [e for e, s in scores.items() if s == best_score]
    winner = best[turn % len(best)]
    reason = PREFIX if hits[winner] > 0 else AFFINITY if affine[winner] else LOAD
    return Decision(winner, reason, best_score)
