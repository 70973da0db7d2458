"""How far one `tessera router` replica goes: requests/s through it to a fast stub upstream.

The upstream is a stub (aiohttp, two ports, answers at once: a fixed completion, or 16 SSE
events), so the router is what is measured, not a model. Scenarios, each with 32 clients in
flight for --seconds after a warm-up:

  * direct: the clients straight to the stub (the stub and client's own ceiling here);
  * load_only: through the router without --model (load and affinity scoring only);
  * prefix: through the router with SmolLM2's tokenizer (every request tokenized and its block
    hashes looked up: 8 shared prefixes of ~200 tokens, a unique tail each);
  * prefix_stream: the same, streamed (16 events per answer).

The router, the stub and the clients share this machine's cores, so the headline is the
router's own cost: requests per CPU-second of the router process (its /proc utime + stime over
the window), i.e. what one router core carries; requests/s on the whole machine is given too.
Writes benchmarks/results/router_throughput_<machine kind>.json + .png.

    .venv/bin/python benchmarks/router_throughput.py [--seconds 10] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from common import environment_info, new_figure, save_figure, write_json  # noqa: E402

from tessera.ports import free_port  # noqa: E402

NAME = "router_throughput"
CONCURRENCY = 32
STREAM_EVENTS = 16
TOKENIZER = "smollm2-135m-instruct"
_COMPLETION = json.dumps(
    {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [{"index": 0, "text": " x"}]}
).encode()
_EVENT = b'data: {"id":"cmpl-stub","object":"text_completion","choices":[{"index":0,"text":" x"}]}\n\n'
_METRICS = b'tessera:num_requests_waiting{model_name="stub"} 0.0\ntessera:kv_cache_usage_perc{model_name="stub"} 0.0\n'


def run_stub(ports: list[int]) -> None:
    """The fast upstream: one process, one listener per port."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=_COMPLETION, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(STREAM_EVENTS):
            await response.write(_EVENT)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=_METRICS, content_type="text/plain")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for port in ports:
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(serve())


@contextmanager
def process(args: list[str], health_url: str) -> Iterator[subprocess.Popen[bytes]]:
    import httpx

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "runtime"), str(REPO)]))
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[:4]} did not start")
            try:
                if httpx.get(health_url, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(count: int) -> list[str]:
    """8 shared prefixes of ~200 tokens (a system prompt each), a unique tail per request."""
    rng = random.Random(0)
    words = [
        "the",
        "cache",
        "keeps",
        "blocks",
        "of",
        "tokens",
        "while",
        "leaders",
        "serve",
        "requests",
        "across",
        "many",
        "pods",
        "and",
        "zones",
    ]
    prefixes = [" ".join(rng.choice(words) for _ in range(180)) for _ in range(8)]
    return [
        f"{prefixes[i % 8]} Question {i}: {' '.join(rng.choice(words) for _ in range(12))}?"
        for i in range(count)
    ]


async def drive(url: str, stream: bool, seconds: float, warmup_s: float) -> dict[str, Any]:
    """CONCURRENCY clients in a loop; the requests that finish inside the timed window."""
    import aiohttp

    bodies = prompts(4096)
    latencies: list[float] = []
    failures = 0
    start = time.monotonic() + warmup_s
    end = start + seconds

    async def client(index: int, session: aiohttp.ClientSession) -> None:
        nonlocal failures
        n = index
        while time.monotonic() < end:
            body = {"model": "stub", "prompt": bodies[n % len(bodies)], "max_tokens": 1, "stream": stream}
            n += CONCURRENCY
            sent = time.monotonic()
            try:
                async with session.post(url, json=body) as response:
                    await response.read()
                    ok = response.status == 200
            except aiohttp.ClientError:
                ok = False
            done = time.monotonic()
            if start <= sent and done <= end:
                if ok:
                    latencies.append(done - sent)
                else:
                    failures += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(i, session) for i in range(CONCURRENCY)))
    latencies.sort()
    return {
        "requests": len(latencies),
        "failures": failures,
        "requests_per_s": len(latencies) / seconds,
        "latency_ms_p50": 1000 * statistics.median(latencies) if latencies else None,
        "latency_ms_p99": 1000 * latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
    }


def measure(url: str, stream: bool, seconds: float, router_pid: int | None) -> dict[str, Any]:
    warmup_s = 2.0
    cpu_before = cpu_seconds(router_pid) if router_pid else 0.0
    wall = time.monotonic()
    result = asyncio.run(drive(url, stream, seconds, warmup_s))
    if router_pid:
        # The window's share of the run's router CPU (warm-up and tail excluded by proportion).
        used = cpu_seconds(router_pid) - cpu_before
        elapsed = time.monotonic() - wall
        window_cpu = used * seconds / elapsed
        result["router_cpu_s"] = window_cpu
        result["router_cpu_ms_per_request"] = 1000 * window_cpu / max(result["requests"], 1)
        result["requests_per_router_cpu_s"] = result["requests"] / window_cpu if window_cpu else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="3 s per scenario")
    parser.add_argument("--stub", type=int, nargs="+", help=argparse.SUPPRESS)  # the upstream's own run
    args = parser.parse_args()
    if args.stub:
        run_stub(args.stub)
        return
    seconds = 3.0 if args.quick else args.seconds
    from tessera.models.registry import resolve_model

    tokenizer_dir = str(resolve_model(TOKENIZER))
    stub_ports = [free_port(), free_port()]
    results: dict[str, Any] = {}
    py = sys.executable
    stub_args = [py, __file__, "--stub", *map(str, stub_ports)]
    with process(stub_args, f"http://127.0.0.1:{stub_ports[0]}/health"):
        results["direct"] = measure(f"http://127.0.0.1:{stub_ports[0]}/v1/completions", False, seconds, None)
        for scenario, model_args, stream in (
            ("load_only", [], False),
            ("prefix", ["--model", tokenizer_dir], False),
            ("prefix_stream", ["--model", tokenizer_dir], True),
        ):
            port = free_port()
            router_args = [py, "-m", "tessera.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
            router_args += [arg for p in stub_ports for arg in ("--endpoint", f"http://127.0.0.1:{p}")]
            router_args += [*model_args, "--log-level", "warning"]
            with process(router_args, f"http://127.0.0.1:{port}/health") as router:
                url = f"http://127.0.0.1:{port}/v1/completions"
                results[scenario] = measure(url, stream, seconds, router.pid)
            print(scenario, json.dumps(results[scenario]), flush=True)
    headline = results["prefix"]["requests_per_router_cpu_s"]
    data = {
        "benchmark": NAME,
        "environment": environment_info(),
        "concurrency": CONCURRENCY,
        "seconds_per_scenario": seconds,
        "stream_events": STREAM_EVENTS,
        "tokenizer": TOKENIZER,
        "scenarios": results,
        "requests_per_router_core_prefix": headline,
    }
    print(f"wrote {write_json(NAME, data)}")
    figure, axes = new_figure(ncols=2, width=5.5)
    names = list(results)
    axes[0][0].bar(names, [results[n]["requests_per_s"] for n in names], color="tab:blue")
    axes[0][0].set_title("requests/s on the whole machine\n(router, stub and clients share its cores)")
    routed = [n for n in names if n != "direct"]
    axes[0][1].bar(routed, [results[n]["requests_per_router_cpu_s"] for n in routed], color="tab:green")
    axes[0][1].set_title("requests per router CPU-second\n(what one router core carries)")
    for ax in axes[0]:
        ax.tick_params(axis="x", rotation=20)
    print(f"wrote {save_figure(NAME, figure)}")


if __name__ == "__main__":
    main()
