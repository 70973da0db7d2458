"""`tessera bench serve [options]`: drive a running `tessera serve` and report its latencies and throughput."""

from __future__ import annotations

import argparse
import asyncio
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from tessera.bench.datasets import BenchRequest, fixed_requests, random_requests


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="default: http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument(
        "--tokenizer", default=None, help="model reference for the tokenizer (default: --model)"
    )
    parser.add_argument("--api-key", default=os.environ.get("TESSERA_API_KEY"))
    parser.add_argument("--dataset-name", choices=["random", "fixed"], default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=64)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--random-prefix-len", type=int, default=0)
    parser.add_argument("--prompt", default="Once upon a time", help="the prompt of the fixed dataset")
    parser.add_argument("--fixed-output-len", type=int, default=64)
    parser.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None, help="file stem (default: bench-serve-<time>)")


def load_tokenizer(ref: str) -> Any:
    from transformers import AutoTokenizer

    from tessera.models.registry import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(ref)))


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if args.dataset_name == "fixed":
        return fixed_requests(tokenizer, args.num_prompts, args.prompt, args.fixed_output_len)
    return random_requests(
        tokenizer,
        args.num_prompts,
        args.random_input_len,
        args.random_output_len,
        args.random_range_ratio,
        args.random_prefix_len,
        args.seed,
    )


def run_bench_serve(args: argparse.Namespace) -> int:
    # Here, not at the top: every `tessera` command registers this one's flags, and a rank
    # process (`tessera worker`) has no use for aiohttp's and the report's 0.4 s of imports.
    from tessera.bench.report import print_summary, write_results
    from tessera.bench.serve import run_benchmark

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    requests = build_requests(args)
    summary, results = asyncio.run(
        run_benchmark(
            base_url,
            args.model,
            requests,
            args.request_rate,
            args.burstiness,
            args.max_concurrency,
            args.api_key,
            args.seed,
        )
    )
    summary |= {
        "model": args.model,
        "dataset": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    print_summary(summary)
    stem = args.result_name or f"bench-serve-{datetime.now():%Y%m%d-%H%M%S}"
    json_path, png_path = write_results(Path(args.result_dir) / stem, summary, results)
    if png_path is None:
        print(f"wrote {json_path} (no plot: matplotlib is not installed)")
    else:
        print(f"wrote {json_path} and {png_path}")
    return 0 if summary["failed_requests"] == 0 else 1


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    """`tessera bench serve`, wired into tessera.cli."""
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="load a running server like `vllm bench serve`")
    add_bench_serve_args(serve)
    serve.set_defaults(handler=run_bench_serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera bench serve")
    add_bench_serve_args(parser)
    return run_bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
