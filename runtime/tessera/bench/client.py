"""One streamed completion request, timed chunk by chunk (TTFT, inter-token latencies, end to end)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from tessera.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # tokens the server reported (usage)
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    error: str = ""


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    request: BenchRequest,
    headers: dict[str, str],
) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(prompt_len=request.prompt_len)
    started = time.perf_counter()
    last = 0.0  # when the latest chunk with choices came; 0 until the first (vLLM's client rules)
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:  # OpenAI's object, or another server's plain string
                    error = chunk["error"]
                    result.error = str(error.get("message", error) if isinstance(error, dict) else error)
                    return result
                now = time.perf_counter()
                # Any chunk with choices counts, even with empty text (a token ending inside a
                # UTF-8 character): TTFT is the first, ITL the gaps, latency ends at the last.
                if chunk.get("choices"):
                    if not last:
                        result.ttft_s = now - started
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_len = int(chunk["usage"].get("completion_tokens") or 0)
        if not last or result.output_len <= 0:
            result.error = "no tokens generated"
            return result
        result.latency_s = last - started
        result.success = True
    except Exception as exc:  # one odd answer fails its request, never the run (as vLLM's bench)
        result.error = repr(exc)
    return result
