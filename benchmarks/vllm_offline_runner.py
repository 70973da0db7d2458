"""Runs inside vLLM's own virtual environment (see ``peers.py``): the offline workload through
``vllm.LLM`` on its CPU backend, timed like Tessera's run (after a warm-up, ``generate`` only),
as a persistent process that runs the workload once per command (one per benchmark round).

Standalone on purpose (stdlib + vllm only): the project's code and pins are not in that venv.
Usage: ``<venv>/bin/python vllm_offline_runner.py JOB.json``; JOB holds the model folder,
dtype, KV cache size and the requests (token ids + output length).

Protocol: stdout carries protocol lines only, one JSON object each. vLLM's own prints and logs
(and its child processes') are sent to stderr. After start-up and a warm-up request the runner
writes ``{"ready": true, "vllm_version": ..., "startup_s": ...}``; then for each line ``run``
read from stdin it empties the prefix cache (each round computes every prompt), generates the
whole workload once and writes
``{"elapsed_s": ..., "outputs": [[token ids of request 0], ...]}``. At EOF on stdin it exits.
Any failure raises: the traceback goes to stderr and the process exits non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def send(protocol: TextIO, message: dict[str, Any]) -> None:
    protocol.write(json.dumps(message) + "\n")
    protocol.flush()


def main(job_path: str) -> None:
    # The protocol keeps the original stdout; fd 1 (inherited by vLLM's child processes too)
    # becomes stderr, so nothing vLLM prints can corrupt a protocol line.
    protocol = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)

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
    send(protocol, {"ready": True, "vllm_version": vllm.__version__, "startup_s": startup_s})

    while command := sys.stdin.readline():
        if command.strip() != "run":
            raise ValueError(f"unknown command {command.strip()!r} (expected 'run')")
        # Every round computes its prompts: an earlier round's blocks would be prefix-cache hits.
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM's prefix cache could not be reset")
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        send(protocol, {"elapsed_s": elapsed, "outputs": [list(r.outputs[0].token_ids) for r in results]})


if __name__ == "__main__":
    main(sys.argv[1])
