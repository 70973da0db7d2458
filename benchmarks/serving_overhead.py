"""Serving overhead: the offline-throughput workload through `tessera serve` at saturation vs. the offline engine.

Same run, same machine, same workload as ``offline_throughput.py`` (64 requests, prompts of
32-256 tokens of real text, 16-128 output tokens each, EOS ignored, greedy, SmolLM2-135M fp32):

1. offline: ``LLM.generate`` on all requests at once (in-process engine core);
2. served: a ``tessera serve`` subprocess (API process + engine core process over ZeroMQ)
   receives every request at once as a streamed completion (``tessera bench serve`` client
   with no rate limit and no concurrency cap: saturation);
3. offline again. Other processes on a shared machine only ever slow a run down, so the
   baseline is the better of the two offline runs (conservative: it raises the bar).

Output throughput counts each request's own output tokens over the wall time from first
send to last completion. Target: serving loses at most 10% of the offline output throughput.
The client runs on the same cores as the server; its CPU use is part of the measured overhead.

Run: ``.venv/bin/python benchmarks/serving_overhead.py [--num-requests 64] [--quick]``.
Writes ``benchmarks/results/serving_overhead_<machine kind>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from common import environment_info, exit_on_sigterm, new_figure, save_figure, set_threads, write_json
from offline_throughput import MODEL, Request, build_workload
from servers import cpu_used, running_server

from tessera.bench.datasets import BenchRequest
from tessera.bench.serve import run_benchmark
from tessera.ports import free_port

TARGET_MAX_OVERHEAD = 0.10
NAME = "serving_overhead"


def run_offline(requests: list[Request], threads: int) -> dict[str, Any]:
    from tessera import LLM, SamplingParams

    llm = LLM(MODEL, dtype="float32", num_threads=threads)
    try:
        llm.generate(
            [{"prompt_token_ids": requests[0].prompt_token_ids[:16]}],
            SamplingParams(temperature=0.0, max_tokens=4),
        )
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params)
        elapsed = time.perf_counter() - started
    finally:
        llm.engine.shutdown()
    output_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    expected = sum(r.output_len for r in requests)
    if output_tokens != expected:
        raise RuntimeError(f"offline produced {output_tokens} tokens, {expected} requested")
    return {
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_throughput": output_tokens / elapsed,
    }


def run_served(requests: list[Request], threads: int) -> dict[str, Any]:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "tessera.cli", "serve", MODEL, "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--num-threads", str(threads), "--served-model-name", "model"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with running_server(args, env, base_url) as server_pid:
        bench = [BenchRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len) for r in requests]
        asyncio.run(run_benchmark(base_url, "model", [BenchRequest(bench[0].prompt[:16], 16, 4)]))  # warm-up
        with cpu_used(server_pid) as cpu_s:
            summary, _ = asyncio.run(run_benchmark(base_url, "model", bench))
    summary["cpu_s"] = cpu_s
    if summary["failed_requests"]:
        raise RuntimeError(f"served run had failures: {summary.get('errors')}")
    expected = sum(r.output_len for r in requests)
    if summary["total_generated_tokens"] != expected:
        raise RuntimeError(
            f"server produced {summary['total_generated_tokens']} tokens, {expected} requested"
        )
    return summary


def plot(offline: list[dict[str, Any]], served: dict[str, Any], overhead: float) -> Path:
    fig, axes = new_figure(ncols=2, width=6.0)
    labels = [f"offline #{i + 1}" for i in range(len(offline))] + ["served"]
    values = [o["output_throughput"] for o in offline] + [served["output_throughput"]]
    bars = axes[0][0].bar(labels, values, color=["tab:blue"] * len(offline) + ["tab:green"])
    axes[0][0].bar_label(bars, fmt="%.0f")
    baseline = max(o["output_throughput"] for o in offline)
    axes[0][0].axhline(
        baseline * (1 - TARGET_MAX_OVERHEAD), color="red", linestyle="--", label="target (-10%)"
    )
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].set_title(f"output throughput (serving overhead {overhead:+.1%})")
    axes[0][0].legend()
    names = ["TTFT", "TPOT", "ITL", "E2EL"]
    keys = ["ttft", "tpot", "itl", "e2el"]
    x = range(len(names))
    for offset, stat in ((-0.25, "mean"), (0.0, "median"), (0.25, "p99")):
        axes[0][1].bar(
            [i + offset for i in x], [served[f"{stat}_{k}_ms"] for k in keys], width=0.25, label=stat
        )
    axes[0][1].set_xticks(list(x), names)
    axes[0][1].set_yscale("log")
    axes[0][1].set_ylabel("ms")
    axes[0][1].set_title("served latencies at saturation")
    axes[0][1].legend()
    return save_figure(NAME, fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads of the engine (default: cores)"
    )
    parser.add_argument("--quick", action="store_true", help="16 requests: a smoke run")
    args = parser.parse_args()
    exit_on_sigterm()
    threads = set_threads(args.threads)
    from transformers import AutoTokenizer

    from tessera.models.registry import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(MODEL)))
    requests = build_workload(tokenizer, 16 if args.quick else args.num_requests, args.seed)
    print(
        f"workload: {len(requests)} requests, {sum(r.output_len for r in requests)} output tokens", flush=True
    )
    offline = [run_offline(requests, threads)]
    print(f"offline: {offline[0]['output_throughput']:.1f} output tok/s", flush=True)
    served = run_served(requests, threads)
    print(f"served:  {served['output_throughput']:.1f} output tok/s (CPU s: {served['cpu_s']})", flush=True)
    offline.append(run_offline(requests, threads))
    print(f"offline: {offline[1]['output_throughput']:.1f} output tok/s", flush=True)
    baseline = max(o["output_throughput"] for o in offline)
    overhead = 1.0 - served["output_throughput"] / baseline
    result = {
        "benchmark": NAME,
        "model": MODEL,
        "num_requests": len(requests),
        "total_output_tokens": sum(r.output_len for r in requests),
        "threads": threads,
        "offline_runs": offline,
        "offline_output_throughput": baseline,
        "served": served,
        "served_output_throughput": served["output_throughput"],
        "overhead": overhead,
        "target_max_overhead": TARGET_MAX_OVERHEAD,
        "meets_target": overhead <= TARGET_MAX_OVERHEAD,
        "environment": environment_info(),
    }
    print(f"serving overhead: {overhead:+.1%} (target <= {TARGET_MAX_OVERHEAD:.0%})")
    print(f"wrote {write_json(NAME, result)} and {plot(offline, served, overhead)}")


if __name__ == "__main__":
    main()
