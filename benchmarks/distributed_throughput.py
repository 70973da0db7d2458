"""Multi-rank throughput: pipeline parallelism with batches in flight, and tensor parallelism.

One torch thread per rank process, a decode-heavy workload (256 concurrent requests of 32 prompt
and 64 output tokens, EOS ignored, greedy) on SmolLM2-135M-Instruct in fp32, all in one run:

- PP=1 (one rank, in the engine core's process);
- PP=2 with one batch at a time (``max_batches_in_flight=1``: the stages take turns);
- PP=2 with two batches in flight (the default: both stages busy), with the engine's even layer
  split and then with a split balanced by measurement: the even run's per-rank compute time gives
  one layer's cost and the last stage's extra (LM head, sampling), and the balanced split is
  the one whose slower stage is fastest (so no CPU's favourite split is written down here);
- TP=1 vs TP=2, on a random-weight model of SmolLM2's shape with 12 query / 4 KV heads of 48
  (SmolLM2's 9 heads do not split over 2 ranks; FLOPs and memory traffic are the same).

For each multi-rank setting it records every rank's time in collectives and in stage-to-stage
transfers (which includes waiting for the previous stage) against its time in steps. On 2 cores
PP=2 can reach at most 2x PP=1; the run also measures how much work two single-thread processes
get done together on this machine versus one alone (vCPUs may share a core or memory bandwidth).

Run: ``.venv/bin/python benchmarks/distributed_throughput.py [--quick]``.
Writes ``benchmarks/results/distributed_throughput_<machine kind>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

from common import environment_info, measure_process_scaling, new_figure, save_figure, write_json

MODEL = "smollm2-135m-instruct"
TARGET_PP_SPEEDUP = 1.8

# (name, model, layout): TP=2 needs heads that split over 2 ranks.
SETTINGS: list[tuple[str, str, dict[str, Any]]] = [
    ("PP=1", MODEL, {}),
    ("PP=2, one batch at a time", MODEL, {"pipeline_parallel_size": 2, "max_batches_in_flight": 1}),
    ("PP=2, batches in flight", MODEL, {"pipeline_parallel_size": 2}),
    ("TP=1 (12 heads)", "even-heads", {}),
    ("TP=2 (12 heads)", "even-heads", {"tensor_parallel_size": 2}),
]


def even_heads_model() -> str:
    """SmolLM2's shape with 12 query and 4 KV heads of 48, random weights, cached beside the model."""
    import shutil

    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from tessera.models.registry import resolve_model

    source = resolve_model(MODEL)
    target = source.parent / f"{source.name}-12-heads"
    if (target / "config.json").exists():
        return str(target)
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 12, 4, 48
    torch.manual_seed(0)
    tmp = target.with_name(target.name + ".tmp")
    LlamaForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, tmp / name)
    tmp.rename(target)
    return str(target)


def workload(num_requests: int, prompt_len: int, seed: int = 0) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(prompt_len)]}
        for _ in range(num_requests)
    ]


def measure(
    model: str, layout: dict[str, Any], prompts: list[Any], output_len: int, **engine_args: Any
) -> dict[str, Any]:
    """Offline output tokens/s of ``layout`` and each rank's communication statistics
    (``engine_args`` over the defaults: moe_throughput.py sizes its cache otherwise)."""
    from tessera import LLM, SamplingParams

    engine_args = {"max_model_len": 512, "kv_cache_memory": 1 << 30, **engine_args}
    llm = LLM(model, num_threads=1, max_num_seqs=len(prompts), **layout, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm up
        executor = llm.engine.executor
        executor.collective_rpc("reset_comm_stats")
        started = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - started
        ranks = executor.collective_rpc("comm_stats")
        num_layers = json.loads((llm.engine.model_dir / "config.json").read_text())["num_hidden_layers"]
    finally:
        llm.engine.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for rank in ranks:
        busy = rank["step_seconds"] or 1e-9
        rank["collective_share"] = rank["collective_seconds"] / busy
        rank["p2p_share"] = rank["p2p_seconds"] / busy
        rank["step_share_of_wall"] = rank["step_seconds"] / seconds
    return {
        "layout": layout,
        "stage_layers": [end - start for start, end in llm.config.parallel.stage_layers(num_layers)],
        "seconds": seconds,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds,
        "ranks": ranks,
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="16 requests of 32 tokens: a smoke run")
    parser.add_argument(
        "--layer-partition",
        default=None,
        help="layers per stage for the PP=2 settings, e.g. 17,13 (default: the engine's even split)",
    )
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 16, 32
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prompts = workload(args.num_requests, args.prompt_len)
    scaling = measure_process_scaling(2)
    print(f"two single-thread processes do {scaling['speedup']:.2f}x one process's work", flush=True)
    results = {}
    partition = [int(n) for n in args.layer_partition.split(",")] if args.layer_partition else None
    for name, model, layout in SETTINGS:
        if partition and layout.get("pipeline_parallel_size") == 2:
            layout = {**layout, "layer_partition": partition}
        results[name] = measure(
            even_heads_model() if model == "even-heads" else model, layout, prompts, args.output_len
        )
        print(f"{name:28s} {results[name]['output_tokens_per_s']:7.1f} output tok/s", flush=True)
        if name == "PP=2, batches in flight" and not partition:
            balanced = balanced_partition(results[name]["ranks"], results[name]["stage_layers"])
            name = f"PP=2, batches in flight, {balanced[0]}/{balanced[1]}"
            results[name] = measure(model, {**layout, "layer_partition": balanced}, prompts, args.output_len)
            print(f"{name:28s} {results[name]['output_tokens_per_s']:7.1f} output tok/s", flush=True)
    for name, result in results.items():
        base = results["TP=1 (12 heads)" if "12 heads" in name else "PP=1"]
        result["speedup_vs_single_rank"] = result["output_tokens_per_s"] / base["output_tokens_per_s"]
        result["same_tokens_as_single_rank"] = result["token_ids"] == base["token_ids"]
    for result in results.values():
        result.pop("token_ids")
    in_flight = max(r["speedup_vs_single_rank"] for n, r in results.items() if "in flight" in n)
    data = {
        "benchmark": "distributed_throughput",
        "model": MODEL,
        "layer_partition": partition,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "threads_per_rank": 1,
        },
        "environment": environment_info(),
        "results": results,
        "process_scaling": scaling,
        "pp2_in_flight_speedup": in_flight,
        "pp2_in_flight_share_of_machine_ceiling": in_flight / scaling["speedup"],
        "target_pp2_speedup": TARGET_PP_SPEEDUP,
        "meets_target": in_flight >= TARGET_PP_SPEEDUP,
    }
    print(
        f"PP=2 with batches in flight: {in_flight:.2f}x PP=1 (target {TARGET_PP_SPEEDUP}x; "
        f"this machine's two-process ceiling {scaling['speedup']:.2f}x)"
    )
    write_json(
        "distributed_throughput" + (f"_partition_{'_'.join(map(str, partition))}" if partition else ""), data
    )
    plot(
        results,
        "distributed_throughput" + (f"_partition_{'_'.join(map(str, partition))}" if partition else ""),
    )


def balanced_partition(ranks: list[dict[str, Any]], stage_layers: list[int]) -> list[int]:
    """Two stages' layer counts that balance their measured compute.

    Stage 0's compute (step time less its sends) over its layers is one layer's cost; stage 1's
    compute (step time less waiting for stage 0) beyond its layers' share is the last stage's
    extra work. The split minimises the slower stage's time.
    """
    first, last = sorted(ranks, key=lambda r: r["rank"])
    layer_cost = (first["step_seconds"] - first["p2p_seconds"]) / stage_layers[0]
    extra = last["step_seconds"] - last["p2p_seconds"] - layer_cost * stage_layers[1]
    total = sum(stage_layers)
    best = min(range(1, total), key=lambda x: max(x * layer_cost, (total - x) * layer_cost + extra))
    return [best, total - best]


def plot(results: dict[str, dict[str, Any]], figure_name: str) -> None:
    figure, axes = new_figure(ncols=2, width=7)
    left, right = axes[0]
    names = list(results)
    left.bar(range(len(names)), [results[n]["output_tokens_per_s"] for n in names], color="#4c72b0")
    left.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=8)
    left.set_ylabel("output tokens / s (one thread per rank)")
    for i, name in enumerate(names):
        left.text(
            i,
            results[name]["output_tokens_per_s"],
            f"{results[name]['speedup_vs_single_rank']:.2f}x",
            ha="center",
        )
    rows = [
        (f"{n.split(',')[0]}{' inflight' if 'flight' in n else ''} r{r['rank']}", r)
        for n in names
        for r in results[n]["ranks"]
    ]
    right.barh(
        range(len(rows)), [r["collective_share"] for _, r in rows], color="#dd8452", label="collectives"
    )
    right.barh(
        range(len(rows)),
        [r["p2p_share"] for _, r in rows],
        left=[r["collective_share"] for _, r in rows],
        color="#55a868",
        label="stage transfers (incl. waiting)",
    )
    right.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    right.set_xlabel("share of the rank's step time")
    right.legend(fontsize=8)
    figure.suptitle("Tessera multi-rank throughput, SmolLM2-135M fp32")
    save_figure(figure_name, figure)


if __name__ == "__main__":
    main()
