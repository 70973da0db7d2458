"""The router's own series on its /metrics (the autoscaler reads held_requests and
requests_at_zero_total to scale an InferenceCluster up from zero)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from tessera.router.scorer import REASONS

PREFIX = "tessera_router_"
UNAVAILABLE_REASONS = ("no_endpoint", "hold_full", "hold_timeout", "unreachable")
UPSTREAM_ERROR_KINDS = ("connect", "midstream", "response")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests_total", "Requests sent to each endpoint.", ["endpoint"], registry=r
        )
        self.decisions = Counter(
            PREFIX + "decisions_total", "Routing decisions by what won them.", ["reason"], registry=r
        )
        self.held = Gauge(PREFIX + "held_requests", "Requests waiting for a Ready endpoint.", registry=r)
        self.at_zero = Counter(
            PREFIX + "requests_at_zero_total",
            "Requests that arrived while no endpoint was Ready.",
            registry=r,
        )
        self.unavailable = Counter(
            PREFIX + "unavailable_total",
            "Requests answered 503 for want of an endpoint.",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            PREFIX + "upstream_errors_total",
            "Failures talking to an endpoint: connect (retried elsewhere), midstream, response.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.inflight = Gauge(
            PREFIX + "inflight_requests", "Open requests per endpoint.", ["endpoint"], registry=r
        )
        self.ready_endpoints = Gauge(PREFIX + "ready_endpoints", "Endpoints taking requests.", registry=r)
        self.prefix_index_entries = Gauge(
            PREFIX + "prefix_index_entries", "Block hashes in the prefix index.", registry=r
        )
        for reason in REASONS:
            self.decisions.labels(reason)
        for reason in UNAVAILABLE_REASONS:
            self.unavailable.labels(reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)
