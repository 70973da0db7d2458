"""Summary statistics of a serving benchmark run, as `vllm bench serve` prints them, plus JSON + PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tessera.bench.client import RequestResult


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    """Mean, median, p99 and std in ms; None (JSON null) without a sample, so that a run whose
    requests all failed does not read as the fastest possible."""
    keys = (f"mean_{name}_ms", f"median_{name}_ms", f"p99_{name}_ms", f"std_{name}_ms")
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    values = (ms.mean(), np.median(ms), np.percentile(ms, 99), ms.std())
    return {key: float(value) for key, value in zip(keys, values, strict=True)}


def summarize(results: list[RequestResult], duration_s: float, peak_concurrency: int) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    # TPOT excludes the first token: (latency - ttft) / (output_len - 1), like vLLM.
    tpots = [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    summary: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_generated_tokens": total_output,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": total_output / duration_s if duration_s else 0.0,
        "total_token_throughput": (total_input + total_output) / duration_s if duration_s else 0.0,
        "peak_concurrency": peak_concurrency,
    }
    summary |= _stats("ttft", [r.ttft_s for r in ok])
    summary |= _stats("tpot", tpots)
    summary |= _stats("itl", [itl for r in ok for itl in r.itl_s])
    summary |= _stats("e2el", [r.latency_s for r in ok])
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    print("{s:=^60}".format(s=" Serving Benchmark Result "))
    rows = [
        ("Successful requests", "successful_requests"),
        ("Failed requests", "failed_requests"),
        ("Benchmark duration (s)", "duration_s"),
        ("Total input tokens", "total_input_tokens"),
        ("Total generated tokens", "total_generated_tokens"),
        ("Request throughput (req/s)", "request_throughput"),
        ("Output token throughput (tok/s)", "output_throughput"),
        ("Total token throughput (tok/s)", "total_token_throughput"),
        ("Peak concurrent requests", "peak_concurrency"),
    ]
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {metric.upper()} (ms)", f"{stat}_{metric}_ms"))
    for label, key in rows:
        value = summary[key]
        shown = f"{value:>20.2f}" if isinstance(value, float) else f"{'n/a' if value is None else value:>20}"
        print(f"{label:<40}{shown}")
    print("=" * 60)


def write_results(
    path_stem: Path, summary: dict[str, Any], results: list[RequestResult]
) -> tuple[Path, Path | None]:
    """`<stem>.json` (summary + per-request samples) and `<stem>.png` (latency distributions,
    throughput); the plot only where matplotlib is installed (the runtime image leaves it out)."""
    path_stem.parent.mkdir(parents=True, exist_ok=True)
    ok = [r for r in results if r.success]
    data = {
        **summary,
        "per_request": [
            {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft_s": r.ttft_s,
                "latency_s": r.latency_s,
            }
            for r in ok
        ],
    }
    json_path = path_stem.with_suffix(".json")
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    try:
        import matplotlib
    except ImportError:
        return json_path, None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
    series = {
        "TTFT (ms)": [r.ttft_s * 1000 for r in ok],
        "ITL (ms)": [x * 1000 for r in ok for x in r.itl_s],
        "E2E latency (ms)": [r.latency_s * 1000 for r in ok],
    }
    for ax, (label, values) in zip(axes[:3], series.items(), strict=True):
        ax.hist(values or [0.0], bins=40, color="tab:blue", alpha=0.8)
        for stat, style in (("median", "--"), ("p99", ":")):
            if values:
                x = float(np.median(values)) if stat == "median" else float(np.percentile(values, 99))
                ax.axvline(x, color="black", linestyle=style, label=f"{stat} {x:.1f}")
        ax.set_xlabel(label)
        ax.set_ylabel("count")
        ax.legend()
    names = ["requests/s", "output tok/s", "total tok/s"]
    values = [summary["request_throughput"], summary["output_throughput"], summary["total_token_throughput"]]
    bars = axes[3].bar(names, values, color=["tab:gray", "tab:green", "tab:orange"])
    axes[3].bar_label(bars, fmt="%.1f")
    axes[3].set_title("throughput")
    fig.suptitle(
        f"tessera bench serve: {summary['successful_requests']} requests in {summary['duration_s']:.1f} s"
    )
    png_path = path_stem.with_suffix(".png")
    fig.savefig(png_path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return json_path, png_path
