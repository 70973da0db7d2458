"""Runs inside vLLM's own virtual environment (see ``peers.py``): the offline workload through
``vllm.LLM`` on its CPU backend, timed like Tessera's run (after a warm-up, ``generate`` only).

Standalone on purpose (stdlib + vllm only): the project's code and pins are not in that venv.
Usage: ``<venv>/bin/python vllm_offline_runner.py JOB.json RESULT.json``; JOB holds the model
folder, dtype, KV cache size and the requests (token ids + output length); RESULT gets the
timing and every request's output token ids.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(job_path: str, result_path: str) -> None:
    job: dict[str, Any] = json.loads(Path(job_path).read_text())
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        seed=0,
        max_model_len=job["max_model_len"],
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        **job.get("engine_args", {}),
    )
    startup_s = time.perf_counter() - started
    requests = job["requests"]
    warm_up = [TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"][:16])]
    llm.generate(warm_up, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=r["output_len"], min_tokens=r["output_len"], ignore_eos=True
        )
        for r in requests
    ]
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    result = {
        "vllm_version": vllm.__version__,
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "outputs": [list(r.outputs[0].token_ids) for r in results],
    }
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
