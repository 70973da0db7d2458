"""`tessera bench serve` against the live server: exact output lengths, complete statistics, JSON + PNG."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web

from tessera.bench import client as client_module
from tessera.bench.client import stream_completion
from tessera.bench.datasets import BenchRequest
from tessera.bench.report import print_summary, summarize
from tessera.bench.serve import arrival_offsets
from tests.fixtures.loopback_http import serving
from tests.serving.server import MODEL_NAME, ServerProcess


def test_bench_serve_random_workload_with_concurrency_cap(
    server: ServerProcess, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = [sys.executable, "-m", "tessera.cli", "bench", "serve", "--base-url", server.base_url]
    args += ["--model", MODEL_NAME, "--tokenizer", str(tiny_llama_dir), "--api-key", str(server.api_key)]
    args += ["--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "10"]
    args += ["--random-range-ratio", "0.5", "--max-concurrency", "4", "--request-rate", "50"]
    args += ["--result-dir", str(tmp_path), "--result-name", "run"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Output token throughput" in done.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["successful_requests"] == 12 and result["failed_requests"] == 0
    assert 1 <= result["peak_concurrency"] <= 4
    # ignore_eos: every request produced exactly the output length it asked for (5..15 tokens).
    outputs = [r["output_len"] for r in result["per_request"]]
    assert sum(outputs) == result["total_generated_tokens"] and all(5 <= n <= 15 for n in outputs)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["output_throughput"] > 0
    assert (tmp_path / "run.png").stat().st_size > 0


def test_a_run_whose_requests_all_failed_reports_no_latency_not_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    failed = [client_module.RequestResult(prompt_len=8, error="HTTP 500") for _ in range(3)]
    summary = summarize(failed, duration_s=2.0, peak_concurrency=3)
    assert summary["failed_requests"] == 3 and summary["output_throughput"] == 0.0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert summary[f"median_{metric}_ms"] is None and summary[f"p99_{metric}_ms"] is None
    print_summary(summary)
    assert "n/a" in capsys.readouterr().out


def test_arrivals_start_at_once_and_average_one_over_the_rate() -> None:
    offsets = arrival_offsets(2001, 4.0, 1.0, random.Random(0))
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert abs(offsets[-1] / 2000 - 0.25) < 0.02  # mean gap 1/rate: the span ends at the last send
    assert arrival_offsets(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


async def test_timings_follow_chunks_with_choices_like_vllms_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first token that decodes to no text still ends TTFT; the usage chunk is no token; latency
    ends at the last token, not at [DONE]; a stream with no token is a failure. The client reads
    a clock the server sets before each chunk: second k of the stream is chunk k."""
    clock = [0.0]
    monkeypatch.setattr(client_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    streams = {
        "empty-first": [
            '{"choices":[{"text":""}]}',
            '{"choices":[{"text":"a"}]}',
            '{"choices":[],"usage":{"completion_tokens":2}}',
        ],
        "usage-only": ['{"choices":[],"usage":{"completion_tokens":0}}'],
        # Other servers' ways to fail mid-stream: each is one failed request, never the run's end.
        "string-error": ['{"choices":[{"text":"a"}]}', '{"error":"model overloaded"}'],
        "usage-without-count": ['{"choices":[{"text":"a"}]}', '{"choices":[],"usage":{"prompt_tokens":3}}'],
        "not-json": ['{"choices":[{"text":"a"}]}', '{"choices": ['],
        "not-an-object": ['["a"]'],
    }

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse()
        await response.prepare(request)
        for index, data in enumerate(streams[body["prompt"]]):
            clock[0] = index + 1.0
            await response.write(f"data: {data}\n\n".encode())
            await asyncio.sleep(0.01)  # each chunk read at its own time
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as port, aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/completions"
        clock[0] = 0.0
        ok = await stream_completion(session, url, "m", BenchRequest("empty-first", 1, 2), {})
        failed = await stream_completion(session, url, "m", BenchRequest("usage-only", 1, 2), {})
        odd = {
            name: await stream_completion(session, url, "m", BenchRequest(name, 1, 2), {})
            for name in ("string-error", "usage-without-count", "not-json", "not-an-object")
        }
    assert odd["string-error"].error == "model overloaded"
    assert all(not result.success and result.error for result in odd.values()), odd
    assert ok.success and ok.output_len == 2 and len(ok.itl_s) == 1
    assert ok.ttft_s == 1.0 and ok.itl_s == [1.0]  # the empty first token counts
    assert ok.latency_s == 2.0  # the last token's chunk, not the usage chunk (3) or [DONE]
    assert not failed.success and failed.error == "no tokens generated"
