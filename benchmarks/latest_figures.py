"""The table of benchmarks/README.md: each kept result's headline, read from its JSON.

Run: ``.venv/bin/python benchmarks/latest_figures.py`` (prints Markdown). The README's table is
this script's output, so its figures are the files' and never retyped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import MACHINE_KINDS, RESULTS_DIR
from offline_throughput import SHORT_DTYPE

RACES = ("offline_throughput_bs64", "serving_vs_vllm")


def kind_files(benchmark: str, kind: str) -> list[Path]:
    """``<benchmark>[_<dtype>]_<kind>.json``: a race may be kept as one file per dtype."""
    return sorted(
        path
        for path in RESULTS_DIR.glob(f"{benchmark}_*{kind}.json")
        if path.stem.removeprefix(benchmark).removesuffix(kind).strip("_") in ("", "fp32", "bf16")
    )


def race_ratios(benchmark: str, data: dict[str, Any]) -> dict[str, float]:
    """Tessera / vLLM output throughput per dtype: offline, or at saturation."""
    if benchmark == "serving_vs_vllm":
        return {d: r["saturation"] for d, r in data["ratio_output_throughput_tessera_over_vllm"].items()}
    return {d: r["ratio_output_tok_s"] for d, r in data["tessera_vs_vllm"].items()}


# SmolLM2-135M's weight shapes (out x in): the layers' and the LM head's.
MODEL_SHAPES = ("960x576", "576x576", "3072x576", "576x1536", "49152x576")


def gemm_verdicts(offline: dict[str, Any]) -> dict[str, str]:
    """The backend the race's own load chose per dtype (``tessera_gemm_selection``, the run's
    thread count, the model's shapes): one name where every shape agrees, else each shape's."""
    threads = f"threads={offline['environment']['torch_num_threads']}"
    chosen: dict[str, dict[str, str]] = {}
    for key, verdict in offline["tessera_gemm_selection"].items():
        dtype, shape, *rest = key.split(":")
        if shape in MODEL_SHAPES and threads in rest:
            chosen.setdefault(SHORT_DTYPE[dtype], {})[shape] = verdict["backend"]
    return {
        dtype: ", ".join(sorted(set(by_shape.values())))
        if len(set(by_shape.values())) == 1
        else ", ".join(f"{shape} {backend}" for shape, backend in by_shape.items())
        for dtype, by_shape in chosen.items()
    }


def serving_overhead(data: dict[str, Any]) -> str:
    return f"{data['overhead']:.1%}"


def cluster_timings(data: dict[str, Any]) -> str:
    rollout = data["rollout"]
    return (
        f"apply -> Ready {data['apply_to_ready_seconds']:.1f} s, killed rank -> Ready "
        f"{data['killed_rank_to_ready_seconds']:.1f} s, rollout {rollout['seconds']:.1f} s "
        f"({rollout['requests_served_during']} requests, {rollout['requests_failed_total']} failed)"
    )


def distributed(data: dict[str, Any]) -> str:
    return (
        f"PP=2 in flight {data['pp2_in_flight_speedup']:.2f}x PP=1 "
        f"({data['pp2_in_flight_share_of_machine_ceiling']:.0%} of the two-process ceiling)"
    )


def pod_creation(data: dict[str, Any]) -> str:
    return ", ".join(
        f"{run['pods']} pods for {run['clusters']} cluster{'s' * (run['clusters'] != 1)} created in "
        f"{run['seconds_to_all_pods_created']:.1f} s"
        for run in data["runs"]
        if run["kubectl_processes"] == 1
    )


def router_throughput(data: dict[str, Any]) -> str:
    scenarios = data["scenarios"]
    return (
        f"{data['requests_per_router_core_prefix']:.0f} requests per router CPU-second with prefix scoring, "
        f"{scenarios['load_only']['requests_per_router_cpu_s']:.0f} without (fast stub upstream)"
    )


# The benchmarks outside the race: file stem's benchmark -> (the command, its headline).
def moe_throughput(data: dict[str, Any]) -> str:
    results = data["results"]
    ratio = results["moe tp2-ep"]["output_tokens_per_s"] / results["moe tp2"]["output_tokens_per_s"]
    over_dense = data["moe_over_dense"]
    return (
        f"MoE / dense of the same active parameters {over_dense['tp1']:.2f}x (tp 1), "
        f"{over_dense['tp2']:.2f}x (tp 2); EP / TP-split experts at tp 2 {ratio:.2f}x"
    )


OTHERS: dict[str, tuple[str, Callable[[dict[str, Any]], str]]] = {
    "cluster_timings": ("sudo .venv/bin/python benchmarks/cluster_timings.py", cluster_timings),
    "distributed_throughput": (".venv/bin/python benchmarks/distributed_throughput.py", distributed),
    "operator_pod_creation": (".venv/bin/python benchmarks/operator_pod_creation.py", pod_creation),
    "moe_throughput": (".venv/bin/python benchmarks/moe_throughput.py", moe_throughput),
    "router_throughput": (".venv/bin/python benchmarks/router_throughput.py", router_throughput),
}


def measured(data: dict[str, Any]) -> str:
    environment = data.get("environment") or {}
    date = (environment.get("timestamp") or data.get("date") or "?")[:10]
    revision = environment.get("git_revision")
    return f"{date} {revision[:7]}" if revision else date


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def one_file(benchmark: str, kind: str, headline: Callable[[dict[str, Any]], str]) -> str:
    path = RESULTS_DIR / f"{benchmark}_{kind}.json"
    return headline(load(path)) if path.exists() else "-"


def race_table() -> list[str]:
    lines = [
        "| machine kind | measured | offline fp32 | offline bf16 | saturation fp32 | saturation bf16 "
        "| GEMM backend fp32 / bf16 | serving overhead |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in MACHINE_KINDS:
        ratios, dates, verdicts = [], set(), {}
        for benchmark in RACES:
            by_dtype: dict[str, float] = {}
            for path in kind_files(benchmark, kind):
                data = load(path)
                by_dtype.update(race_ratios(benchmark, data))
                dates.add(measured(data))
                if benchmark == "offline_throughput_bs64":
                    verdicts.update(gemm_verdicts(data))
            ratios += [f"{by_dtype[d]:.2f}x" if d in by_dtype else "-" for d in SHORT_DTYPE]
        gemm = " / ".join(verdicts.get(d, "-") for d in SHORT_DTYPE.values())
        overhead = one_file("serving_overhead", kind, serving_overhead)
        lines.append(f"| {kind} | {', '.join(sorted(dates))} | {' | '.join(ratios)} | {gemm} | {overhead} |")
    return lines


def others_table() -> list[str]:
    lines = ["| benchmark | machine kind | measured | latest figure |", "| --- | --- | --- | --- |"]
    for benchmark, (command, headline) in OTHERS.items():
        for kind in MACHINE_KINDS:
            path = RESULTS_DIR / f"{benchmark}_{kind}.json"
            if path.exists():
                data = load(path)
                lines.append(f"| `{command}` | {kind} | {measured(data)} | {headline(data)} |")
    return lines


if __name__ == "__main__":
    print("\n".join([*race_table(), "", *others_table()]))
