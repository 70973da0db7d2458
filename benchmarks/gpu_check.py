"""The GPU path end to end on one device: greedy equivalence, the Triton kernels, decode throughput.

1. Greedy outputs through ``tessera.LLM`` equal transformers' greedy ``generate`` on the same
   device (fp32: identical or a near-tie at the first difference; bf16: the count identical).
2. The Triton attention kernels against the PyTorch reference
   (``tessera.kernels.paged_attention_reference``) on the device.
3. Offline decode throughput at several batch sizes with CUDA graphs on and off
   (``enforce_eager``), beside transformers' static-batch ``generate``, and as a fraction of
   the memory-bandwidth bound: the bytes a decode step reads (weights + the KV cache of the
   batch's mean context) over the device's measured copy bandwidth.

Writes ``gpu_check_<tag>.json`` and ``.png`` into ``--out`` (default ``benchmarks/results``);
the tag is ``TESSERA_BENCH_TAG`` or the device's name. ``--device cpu`` is a smoke run (tiny
model, the Triton kernels under Triton's interpreter, no graphs: CPUs have none) that the tests
run. The runtime is imported from this checkout (``runtime/``), no install needed: on a GPU
machine with its own torch only the packages listed in benchmarks/README.md must be added.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT / "runtime"), str(REPO_ROOT)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--model",
        default=None,
        help="alias, Hugging Face folder or .gguf (default: smollm2-135m-instruct; cpu: a tiny random Llama)",
    )
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON and PNG")
    parser.add_argument(
        "--batch-sizes", default=None, help="comma-separated (default: 1,16,64,256; cpu: 1,4)"
    )
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (128; cpu: 4)")
    parser.add_argument("--prompt-len", type=int, default=32)
    return parser.parse_args(argv)


ARGS = parse_args()
SMOKE = ARGS.device == "cpu"
if SMOKE:
    # Read when the kernels are decorated and when the backend is chosen: before tessera imports them.
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["TESSERA_ATTENTION_BACKEND"] = "triton"

import torch  # noqa: E402
from common import environment_info, new_figure, package_version  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def device_facts(device: torch.device) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "transformers": package_version("transformers"),
    }
    if device.type != "cuda":
        return facts | {"name": "cpu", "driver": None, "cuda": None}
    props = torch.cuda.get_device_properties(device)
    driver = None  # the kernel driver's version, as nvidia-smi prints it (torch does not say)
    with contextlib.suppress(OSError, IndexError, subprocess.TimeoutExpired):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()[0]
    return facts | {
        "name": props.name,
        "driver": driver,
        "cuda": torch.version.cuda,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give back what a finished engine or model held, before the next one starts."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, megabytes: int) -> float:
    """Best GB/s of a large device-to-device copy, counting the bytes read and written."""
    source = torch.ones(megabytes << 18, device=device)  # fp32: 2**18 per MB
    target = torch.empty_like(source)
    best = 0.0
    for _ in range(5):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = max(best, 2 * source.numel() * 4 / (time.perf_counter() - started))
    return best / 1e9


# --- 1. greedy equivalence ---------------------------------------------------------------------


def transformers_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()


def transformers_greedy(model: Any, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """One prompt's greedy continuation (no padding), and the top-two logprob gap at each token."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    gaps = []
    for scores in out.scores:
        top = scores[0].float().log_softmax(-1).topk(2).values
        gaps.append(float(top[0] - top[1]))
    return out.sequences[0, len(prompt) :].tolist(), gaps


def greedy_check(model_dir: Path, dtype_name: str, device: torch.device, new_tokens: int) -> dict[str, Any]:
    from tessera import LLM, SamplingParams
    from tests.distributed.equivalence import NEAR_TIE
    from tests.engine.test_llm_greedy import prompts_of_varied_lengths

    prompts = prompts_of_varied_lengths()[: 4 if SMOKE else None]
    llm = LLM(str(model_dir), dtype=dtype_name, device=device.type, max_model_len=512, num_kv_blocks=512)
    try:
        tokenizer = llm.get_tokenizer()
        prompt_ids = [tokenizer(p).input_ids for p in prompts]
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        got = [
            list(r.outputs[0].token_ids)
            for r in llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params)
        ]
        graphs = llm.engine.executor.worker.runner.decode_graphs
        replays = None if graphs is None else graphs.replays
    finally:
        llm.engine.shutdown()
        release(device)
    model = transformers_model(model_dir, DTYPES[dtype_name], device)
    identical, near_ties, mismatches = 0, [], []
    for index, (prompt, ours) in enumerate(zip(prompt_ids, got, strict=True)):
        want, gaps = transformers_greedy(model, prompt, new_tokens)
        if ours == want:
            identical += 1
            continue
        position = next(i for i, (a, b) in enumerate(zip(want, ours, strict=False)) if a != b)
        entry = {"request": index, "token": position, "gap": gaps[position]}
        (near_ties if gaps[position] < NEAR_TIE else mismatches).append(entry)
    del model
    release(device)
    result = {
        "dtype": dtype_name,
        "requests": len(prompts),
        "new_tokens": new_tokens,
        "identical": identical,
        "near_ties": near_ties,
        "mismatches": mismatches,
        "graph_replays": replays,
    }
    # fp32 must match up to near-ties; bf16's roundings differ between the two, so it is counted.
    result["passed"] = not mismatches if dtype_name == "float32" else None
    return result


# --- 2. Triton attention against the reference ---------------------------------------------------

# (cached, new, heads, kv_heads, head_dim, window, softcap, min_partition_size): what the kernel
# tests cover, at the device's own sizes too (a long split decode).
ATTENTION_CASES = [
    ([0, 12, 52, 30], [1, 1, 1, 1], 8, 2, 32, None, 0.0, 16),
    ([17, 33, 0, 11, 8], [1, 1, 23, 9, 1], 4, 2, 32, 10, 2.0, 16),
    ([13, 32], [6, 20], 8, 1, 32, None, 0.0, 256),
    ([10, 0], [1, 7], 2, 1, 96, None, 0.0, 256),
]
LONG_CASE = ([3000, 1500, 4000], [1, 1, 1], 9, 3, 64, None, 0.0, 256)


def attention_check(device: torch.device) -> dict[str, Any]:
    import tessera.kernels.triton as kernels
    from tessera.kernels.paged_attention_reference import (
        TOLERANCE,
        make_batch,
        reference_attention,
        reference_write,
        run_kernels,
    )

    cases = ATTENTION_CASES + ([] if SMOKE else [LONG_CASE])
    results = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for cached, new, heads, kv_heads, head_dim, window, softcap, partition in cases:
            batch = make_batch(cached, new, heads, kv_heads, head_dim, dtype, device=device)
            if all(n == 1 for n in new):  # a decode of a one-token prompt too (cached 0)
                batch.num_decodes = len(new)
            scale = head_dim**-0.5
            kv_cache, out = run_kernels(kernels, batch, scale, window, softcap, partition)
            expected = reference_attention(batch, kv_cache, scale, window, softcap)
            error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            results.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "cached": cached,
                    "new": new,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": head_dim,
                    "cache_write_exact": bool(torch.equal(kv_cache, reference_write(batch))),
                    "relative_error": error,
                    "tolerance": TOLERANCE[dtype],
                }
            )
    passed = all(r["cache_write_exact"] and r["relative_error"] < r["tolerance"] for r in results)
    return {"interpreted": kernels.INTERPRETED, "cases": results, "passed": passed}


# --- 3. decode throughput ------------------------------------------------------------------------


def workload(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, prompt_len), generator=generator).tolist()


def tessera_throughput(
    model_dir: Path,
    dtype_name: str,
    device: torch.device,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
    eager: bool,
) -> tuple[list[float], dict[str, Any]]:
    """Output tokens/s of LLM.generate per batch size (prefill included: prompts are short)."""
    from tessera import LLM, SamplingParams

    max_model_len = prompt_len + new_tokens + 16
    llm = LLM(
        str(model_dir),
        dtype=dtype_name,
        device=device.type,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches) * prompt_len),
        max_model_len=max_model_len,
        # Every request's blocks at once (no preemption), and no profiled step to size them.
        num_kv_blocks=max(batches) * -(-max_model_len // 16) + 16,
        block_size=16,
        enforce_eager=eager,
    )
    started = time.perf_counter()
    try:
        runner = llm.engine.executor.worker.runner
        vocab = runner.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": workload(1, prompt_len, vocab)[0]}], params)  # warm-up
        rates = []
        for batch in batches:
            prompts = [{"prompt_token_ids": ids} for ids in workload(batch, prompt_len, vocab)]
            llm.reset_prefix_cache()
            synchronize(device)
            begin = time.perf_counter()
            llm.generate(prompts, params)
            synchronize(device)
            rates.append(batch * new_tokens / (time.perf_counter() - begin))
        graphs = runner.decode_graphs
        info = {
            "graph_sizes": None if graphs is None else graphs.sizes,
            "graph_replays": None if graphs is None else graphs.replays,
            "startup_and_runs_s": time.perf_counter() - started,
        }
    finally:
        llm.engine.shutdown()
        release(device)
    return rates, info


def transformers_throughput(
    model: Any, batches: list[int], prompt_len: int, new_tokens: int, vocab: int
) -> list[float]:
    device = next(model.parameters()).device
    rates = []
    for batch in batches:
        ids = torch.tensor(workload(batch, prompt_len, vocab), device=device)
        with torch.inference_mode():
            synchronize(device)
            begin = time.perf_counter()
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            synchronize(device)
        assert out.shape[1] == prompt_len + new_tokens
        rates.append(batch * new_tokens / (time.perf_counter() - begin))
    return rates


def bytes_per_step(model: Any, batch: int, context: float, dtype: torch.dtype) -> float:
    """Weights (each parameter once: tied embeddings read once, by the LM head) + the KV cache a
    decode step of ``batch`` rows at a mean ``context`` reads."""
    config = model.config
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in model.parameters()) * size
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size
    return weights + batch * context * kv


def throughput_check(
    model_dir: Path,
    dtype_name: str,
    device: torch.device,
    batches: list[int],
    prompt_len: int,
    new_tokens: int,
) -> dict[str, Any]:
    modes = {"eager": True} if SMOKE else {"graphs": False, "eager": True}
    tessera: dict[str, Any] = {}
    for mode, eager in modes.items():
        rates, info = tessera_throughput(
            model_dir, dtype_name, device, batches, prompt_len, new_tokens, eager
        )
        tessera[mode] = {"output_tok_s": rates, **info}
    if SMOKE:
        tessera["graphs"] = "not applicable (no CUDA graphs on CPU)"
    dtype = DTYPES[dtype_name]
    model = transformers_model(model_dir, dtype, device)
    hf = transformers_throughput(model, batches, prompt_len, new_tokens, int(model.config.vocab_size))
    bandwidth = copy_bandwidth(device, 64 if SMOKE else 2048)
    context = prompt_len + new_tokens / 2
    per_step = [bytes_per_step(model, batch, context, dtype) for batch in batches]
    bound = [batch * bandwidth * 1e9 / step for batch, step in zip(batches, per_step, strict=True)]
    del model
    release(device)
    fractions = {
        mode: [rate / limit for rate, limit in zip(entry["output_tok_s"], bound, strict=True)]
        for mode, entry in tessera.items()
        if isinstance(entry, dict)
    }
    return {
        "dtype": dtype_name,
        "batch_sizes": batches,
        "prompt_len": prompt_len,
        "output_len": new_tokens,
        "tessera": tessera,
        "transformers_output_tok_s": hf,
        "copy_bandwidth_gb_s": bandwidth,
        "bytes_per_step": per_step,
        "bandwidth_bound_tok_s": bound,
        "fraction_of_bound": fractions,
        "method": "output tokens / wall time of one generate per batch (prefill of short prompts "
        "included); bound = batch / (bytes per step / copy bandwidth), bytes = weights + KV at the "
        "mean context",
    }


def plot(result: dict[str, Any], path: Path) -> None:
    throughput = result["throughput"]
    figure, axes = new_figure(width=7.0)
    ax = axes[0][0]
    batches = throughput["batch_sizes"]
    series = {
        f"Tessera {mode}": e["output_tok_s"]
        for mode, e in throughput["tessera"].items()
        if isinstance(e, dict)
    }
    series["transformers generate"] = throughput["transformers_output_tok_s"]
    series["bandwidth bound"] = throughput["bandwidth_bound_tok_s"]
    for label, values in series.items():
        ax.plot(
            batches, values, marker="o", linestyle="--" if label == "bandwidth bound" else "-", label=label
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    greedy = result["greedy"]
    ax.set_title(
        f"{result['device']['name']} {throughput['dtype']}: greedy "
        + ", ".join(f"{g['dtype']} {g['identical']}/{g['requests']}" for g in greedy)
        + f", attention {'ok' if result['triton_attention']['passed'] else 'FAILED'}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> int:
    device = torch.device(ARGS.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU (use --device cpu for the smoke run)")
    if SMOKE:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    batches = [int(b) for b in (ARGS.batch_sizes or ("1,4" if SMOKE else "1,16,64,256")).split(",")]
    new_tokens = ARGS.output_len or (4 if SMOKE else 128)
    scratch = tempfile.TemporaryDirectory(prefix="tessera-gpu-check-")
    if ARGS.model is not None:
        from tessera.models.registry import resolve_model

        model_dir = resolve_model(ARGS.model)
    elif SMOKE:
        from tests.fixtures.models import make_tiny_model_dir

        model_dir = make_tiny_model_dir(Path(scratch.name) / "tiny-llama", num_layers=2)
    else:
        from tessera.models.registry import resolve_model

        model_dir = resolve_model("smollm2-135m-instruct")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "gpu_check",
        "smoke": SMOKE,
        "model": str(ARGS.model or model_dir.name),
        "device": device_facts(device),
        "environment": environment_info(),
    }
    print(f"device: {result['device']}", flush=True)
    result["triton_attention"] = attention_check(device)
    print(f"triton attention passed: {result['triton_attention']['passed']}", flush=True)
    greedy_dtypes = ["float32"] if SMOKE else ["float32", "bfloat16"]
    result["greedy"] = [greedy_check(model_dir, name, device, 8 if SMOKE else 32) for name in greedy_dtypes]
    for entry in result["greedy"]:
        print(f"greedy {entry['dtype']}: {entry['identical']}/{entry['requests']} identical", flush=True)
    dtype_name = "float32" if SMOKE else "bfloat16"
    result["throughput"] = throughput_check(
        model_dir, dtype_name, device, batches, ARGS.prompt_len, new_tokens
    )
    print(f"throughput: {result['throughput']['tessera']}", flush=True)
    result["seconds"] = time.perf_counter() - started
    out = ARGS.out or REPO_ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    tag = os.environ.get("TESSERA_BENCH_TAG") or result["device"]["name"].lower().replace(" ", "_")
    stem = out / f"gpu_check_{tag}{'_smoke' if SMOKE else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, stem.with_suffix(".png"))
    print(f"wrote {stem}.json and .png in {result['seconds']:.0f} s")
    scratch.cleanup()
    passed = result["triton_attention"]["passed"] and all(g["passed"] is not False for g in result["greedy"])
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
