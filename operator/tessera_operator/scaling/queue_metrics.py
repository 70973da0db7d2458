"""Reads the queue-depth gauge from Ready leaders' /metrics (the autoscaler's one input).

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
from tessera_operator.scaling.autoscaler import parse_gauge

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


async def _scrape(session: aiohttp.ClientSession, pod: dict[str, Any], metric: str) -> float | None:
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
    return parse_gauge(body.decode("utf-8", errors="replace"), metric)


async def _read_whole(response: aiohttp.ClientResponse) -> bytes | None:
    """The whole body up to MAX_BODY_BYTES, or None past it: a page cut short is never parsed."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)
