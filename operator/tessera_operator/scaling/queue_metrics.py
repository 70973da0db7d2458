"""Reads the queue-depth gauge from Ready leaders' /metrics (the autoscaler's input), and with
minReplicas 0 the router pods' own series (`router_sample`).

A leader that does not answer in time, answers an error, or lacks the gauge gives None: the
autoscaler then treats its group as unmeasured, never as idle.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Iterable
from typing import Any

import aiohttp

from tessera.topology import DEFAULT_API_PORT
from tessera_operator.scaling.autoscaler import RouterSample, parse_gauge

log = logging.getLogger("tessera_operator.scaling.queue_metrics")
SCRAPE_TIMEOUT_SECONDS = 3.0
MAX_BODY_BYTES = 4 << 20  # a metrics page is a few KB: never read an unbounded answer


def metrics_url(pod: dict[str, Any]) -> str | None:
    """http://<podIP>:<the container port named http>/metrics, or None before the pod has an IP."""
    address = (pod.get("status") or {}).get("podIP")
    if not address:
        return None
    port = DEFAULT_API_PORT
    for container in pod["spec"].get("containers") or []:
        for p in container.get("ports") or []:
            if p.get("name") == "http":
                port = int(p["containerPort"])
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}/metrics"


async def queue_depths(leaders: Iterable[dict[str, Any]], metric: str) -> list[float | None]:
    """The gauge at each leader, concurrently, in order."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(_scrape(session, pod, metric) for pod in leaders)))


# The router's series (runtime/tessera/router/metrics.py) in RouterSample's order.
ROUTER_SERIES = (
    "tessera_router_held_requests",
    "tessera_router_inflight_requests",
    "tessera_router_requests_total",
    "tessera_router_requests_at_zero_total",
)


async def router_sample(pods: Iterable[dict[str, Any]]) -> RouterSample | None:
    """The router's series summed over its Ready pods that answered; None when none did."""
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        pages = await asyncio.gather(*(_scrape_text(session, pod) for pod in pods))
    parsed = [[parse_gauge(page, name) for name in ROUTER_SERIES] for page in pages if page is not None]
    answered = [values for values in parsed if None not in values]
    if not answered:
        return None
    held, inflight, requests, at_zero = (
        sum(v or 0.0 for v in column) for column in zip(*answered, strict=True)
    )
    return RouterSample(held, inflight, requests, at_zero, unanswered=len(pages) - len(answered))


async def _scrape(session: aiohttp.ClientSession, pod: dict[str, Any], metric: str) -> float | None:
    text = await _scrape_text(session, pod)
    return None if text is None else parse_gauge(text, metric)


async def _scrape_text(session: aiohttp.ClientSession, pod: dict[str, Any]) -> str | None:
    url = metrics_url(pod)
    if url is None:
        return None
    try:
        async with session.get(url) as response:
            if response.status != 200:
                log.info("%s answered %d", url, response.status)
                return None
            body = await _read_whole(response)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        log.info("%s: %s", url, exc or type(exc).__name__)
        return None
    if body is None:
        log.info("%s: a metrics page over %d bytes", url, MAX_BODY_BYTES)
        return None
    return body.decode("utf-8", errors="replace")


async def _read_whole(response: aiohttp.ClientResponse) -> bytes | None:
    """The whole body up to MAX_BODY_BYTES, or None past it: a page cut short is never parsed."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)
