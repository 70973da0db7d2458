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
        for request in requests:
            tasks.append(asyncio.create_task(one(session, request)))
            if request_rate != float("inf"):
                # Gamma inter-arrivals with mean 1/rate; shape 1 is a Poisson process.
                await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - started
    return summarize(results, duration, peak), results
