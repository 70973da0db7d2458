"""The router's state: the endpoint set, each endpoint's load and open requests, the prefix
index and the session map; `pick` runs the scorer over the Ready endpoints."""

from __future__ import annotations

from collections.abc import Callable, Collection

from tessera.router.hold import HoldRoom
from tessera.router.load import LoadPoller
from tessera.router.lru import BoundedLRU
from tessera.router.metrics import RouterMetrics
from tessera.router.prefix_index import PrefixIndex
from tessera.router.scorer import Decision, EndpointLoad, ScoreWeights, choose


class RoutingState:
    def __init__(
        self,
        poller_factory: Callable[[Callable[[], None]], LoadPoller],
        weights: ScoreWeights,
        prefix_index_entries: int,
        session_entries: int,
        hold: HoldRoom,
        metrics: RouterMetrics,
    ) -> None:
        self.endpoints: frozenset[str] = frozenset()
        self.inflight: dict[str, int] = {}
        self.poller = poller_factory(self._on_health_change)
        self.weights = weights
        self.index = PrefixIndex(prefix_index_entries)
        self.sessions: BoundedLRU[str, str] = BoundedLRU(session_entries)
        self.hold = hold
        self.metrics = metrics
        self._turn = 0

    def set_endpoints(self, endpoints: frozenset[str]) -> None:
        """A new set from the EndpointSource: a removed endpoint gets no new request (its open
        ones finish on their own connections)."""
        for gone in self.endpoints - endpoints:
            if self.inflight.get(gone) == 0:  # nothing open on it: forget it
                del self.inflight[gone]
                self.metrics.inflight.remove(gone)
        self.endpoints = endpoints
        self.poller.set_endpoints(endpoints)
        self._on_health_change()

    def _on_health_change(self) -> None:
        self.metrics.ready_endpoints.set(len(self.ready()))
        self.hold.notify()

    def ready(self, exclude: Collection[str] = ()) -> list[str]:
        return [e for e in self.endpoints if e not in exclude and self.poller.is_ready(e)]

    def pick(
        self, block_hashes: list[bytes], session: str | None, exclude: Collection[str] = ()
    ) -> Decision | None:
        ready = self.ready(exclude)
        if not ready:
            return None
        loads = {}
        for endpoint in ready:
            polled = self.poller.loads.get(endpoint)
            waiting, kv = (polled.waiting, polled.kv_usage) if polled is not None else (0.0, 0.0)
            loads[endpoint] = EndpointLoad(waiting, kv, self.inflight.get(endpoint, 0))
        matched = self.index.matched_blocks(block_hashes, ready) if block_hashes else {}
        affinity = self.sessions.get(session) if session else None
        self._turn += 1
        decision = choose(ready, loads, matched, len(block_hashes), affinity, self.weights, self._turn)
        assert decision is not None
        if block_hashes:
            self.index.record(block_hashes, decision.endpoint)
            self.metrics.prefix_index_entries.set(len(self.index))
        if session:
            self.sessions.put(session, decision.endpoint)
        return decision

    def opened(self, endpoint: str) -> None:
        self.inflight[endpoint] = self.inflight.get(endpoint, 0) + 1
        self.metrics.inflight.labels(endpoint).set(self.inflight[endpoint])
        self.metrics.requests.labels(endpoint).inc()

    def closed(self, endpoint: str) -> None:
        left = self.inflight[endpoint] - 1
        if left == 0 and endpoint not in self.endpoints:  # drained: forget it
            del self.inflight[endpoint]
            self.metrics.inflight.remove(endpoint)
            return
        self.inflight[endpoint] = left
        self.metrics.inflight.labels(endpoint).set(left)
