"""The load generator: Poisson (or gamma-bursty) arrivals and/or a concurrency cap, like `vllm bench serve`."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp

from tessera.bench.client import RequestResult, stream_completion
from tessera.bench.datasets import BenchRequest
from tessera.bench.report import summarize


async def run_benchmark(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> tuple[dict[str, Any], list[RequestResult]]:
    """Send every request; returns the summary and the per-request results."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    in_flight = 0
    peak = 0

    async def one(session: aiohttp.ClientSession, request: BenchRequest) -> RequestResult:
        nonlocal in_flight, peak
        if semaphore is not None:
            await semaphore.acquire()
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await stream_completion(session, url, model, request, headers)
        finally:
            in_flight -= 1
            if semaphore is not None:
                semaphore.release()

    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)  # the concurrency cap is ours, not the pool's
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        tasks = []
        arrivals = arrival_offsets(len(requests), request_rate, burstiness, rng)
        for request, arrival in zip(requests, arrivals, strict=True):
            # Sleeping until each arrival (not for each gap) keeps the event loop's lag from
            # lowering the rate; the first request goes at once, and none waits after the last.
            delay = arrival - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session, request)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
    return summarize(results, duration, peak), results


def arrival_offsets(count: int, request_rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which each request is sent: gamma inter-arrivals with mean
    1/rate (shape 1 is a Poisson process), the first at 0; all at 0 for an infinite rate."""
    offsets = [0.0] * count
    if request_rate == float("inf"):
        return offsets
    for index in range(1, count):
        offsets[index] = offsets[index - 1] + rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
    return offsets
