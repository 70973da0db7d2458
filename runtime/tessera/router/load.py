"""Each endpoint's load, read from its /metrics (vLLM's names under `tessera:`, or `vllm:` from
a server with --metrics-prefix vllm) and its health from /health, every poll interval. An
endpoint whose poll fails is not Ready until one succeeds again."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("tessera.router")

WAITING = "num_requests_waiting"
KV_USAGE = "kv_cache_usage_perc"
METRIC_PREFIXES = ("tessera:", "vllm:")
POLL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PolledLoad:
    healthy: bool
    waiting: float = 0.0
    kv_usage: float = 0.0


def parse_load(page: str) -> tuple[float, float]:
    """(waiting, KV usage) from a Prometheus page: waiting summed over the models it serves, the
    highest KV usage; (0, 0) for series it lacks (a server exports every series from start-up)."""
    waiting, kv_usage = 0.0, 0.0
    for family in text_string_to_metric_families(page):
        for prefix in METRIC_PREFIXES:
            if family.name == prefix + WAITING:
                waiting = max(waiting, sum(sample.value for sample in family.samples))
            elif family.name == prefix + KV_USAGE:
                kv_usage = max([kv_usage, *(sample.value for sample in family.samples)])
    return waiting, kv_usage


class LoadPoller:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        interval_s: float,
        on_health_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.session = session
        self.interval_s = interval_s
        self.on_health_change = on_health_change
        self.loads: dict[str, PolledLoad] = {}
        self._endpoints: frozenset[str] = frozenset()

    def set_endpoints(self, endpoints: Iterable[str]) -> None:
        self._endpoints = frozenset(endpoints)
        for gone in set(self.loads) - self._endpoints:
            del self.loads[gone]

    def is_ready(self, endpoint: str) -> bool:
        """Ready until a poll says otherwise: a new endpoint takes requests before its first poll."""
        load = self.loads.get(endpoint)
        return load is None or load.healthy

    def mark_unhealthy(self, endpoint: str) -> None:
        """A request could not connect: no more requests until a poll succeeds."""
        if endpoint in self._endpoints:
            self.loads[endpoint] = PolledLoad(healthy=False)
            self.on_health_change()

    async def run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.interval_s)

    async def poll_all(self) -> None:
        endpoints = sorted(self._endpoints)
        results = await asyncio.gather(*(self._poll(e) for e in endpoints))
        changed = False
        for endpoint, load in zip(endpoints, results, strict=True):
            if endpoint not in self._endpoints:  # removed while polled
                continue
            changed |= self.is_ready(endpoint) != load.healthy
            self.loads[endpoint] = load
        if changed:
            self.on_health_change()

    async def _poll(self, endpoint: str) -> PolledLoad:
        timeout = aiohttp.ClientTimeout(total=POLL_TIMEOUT_S)
        try:
            async with self.session.get(f"{endpoint}/health", timeout=timeout) as health:
                if health.status != 200:
                    return PolledLoad(healthy=False)
            async with self.session.get(f"{endpoint}/metrics", timeout=timeout) as response:
                page = await response.text() if response.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError) as exc:
            logger.debug("polling %s: %s", endpoint, exc)
            return PolledLoad(healthy=False)
        try:
            waiting, kv_usage = parse_load(page)
        except ValueError as exc:  # not a Prometheus page: healthy, load unknown (counted as idle)
            logger.warning("%s/metrics is not a Prometheus page (%s)", endpoint, exc)
            waiting, kv_usage = 0.0, 0.0
        return PolledLoad(healthy=True, waiting=waiting, kv_usage=kv_usage)
