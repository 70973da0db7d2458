"""Greedy equivalence of a parallel layout with TP=1/PP=1, token for token.

A mismatch is accepted only at a genuine near-tie: the reference's two most likely tokens at
the first differing position are within ``NEAR_TIE`` in log-probability (fp32). The harness
reports every near-tie it accepted; any other mismatch fails.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from tessera import LLM, SamplingParams
from tessera.outputs import CompletionOutput
from tests.engine.test_llm_greedy import StatsRecorder

NEAR_TIE = 1e-4
PROMPT_LOGPROB_TOLERANCE = 1e-4


@dataclass
class Workload:
    """Concurrent requests of different lengths under chunked prefill and KV-cache pressure."""

    prompts: list[Any]
    params: SamplingParams
    engine_args: dict[str, Any]


def token_prompts(count: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]}
        for _ in range(count)
    ]


@dataclass
class Run:
    outputs: list[CompletionOutput]
    preemptions: int
    prompt_logprobs: list[list[float]]  # per request (when asked for): each prompt token's after the first
    comm_stats: list[dict[str, Any]] = field(default_factory=list)  # per rank, with ``comm_stats=True``


def run(model: str, workload: Workload, comm_stats: bool = False, **layout: Any) -> Run:
    """``comm_stats``: also each rank's communication counters over the generation (ranks > 1)."""
    llm = LLM(model, **workload.engine_args, **layout)
    try:
        recorder = StatsRecorder(llm)
        if comm_stats:
            llm.engine.executor.collective_rpc("reset_comm_stats")
        results = llm.generate(workload.prompts, workload.params)
        stats = llm.engine.executor.collective_rpc("comm_stats") if comm_stats else []
        prompt_logprobs = [
            [
                entry[token].logprob
                for entry, token in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:], strict=True)
            ]
            for r in results
            if r.prompt_logprobs is not None
        ]
        return Run([r.outputs[0] for r in results], recorder.preemptions, prompt_logprobs, stats)
    finally:
        llm.engine.shutdown()


def top_two_gap(entry: dict[int, Any]) -> float:
    ranked = sorted((lp.logprob for lp in entry.values() if lp.rank in (1, 2)), reverse=True)
    return ranked[0] - ranked[1]


def compare_prompt_logprobs(reference: Run, candidate: Run, label: str) -> None:
    """The prompts' logprobs agree within fp32 reassociation (the TP shards sum in another order)."""
    assert len(candidate.prompt_logprobs) == len(reference.prompt_logprobs)
    for index, (ref, got) in enumerate(
        zip(reference.prompt_logprobs, candidate.prompt_logprobs, strict=True)
    ):
        worst = max((abs(a - b) for a, b in zip(ref, got, strict=True)), default=0.0)
        assert worst < PROMPT_LOGPROB_TOLERANCE, (
            f"{label}: request {index}'s prompt logprobs differ by {worst:.1e}"
        )


def compare(reference: list[CompletionOutput], candidate: list[CompletionOutput], label: str) -> list[str]:
    """Fail on any mismatch that is not a near-tie; return a description of each near-tie."""
    near_ties = []
    for index, (ref, got) in enumerate(zip(reference, candidate, strict=True)):
        if ref.token_ids == got.token_ids:
            continue
        position = next(
            (i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=False)) if a != b),
            min(len(ref.token_ids), len(got.token_ids)),
        )
        assert position < len(ref.token_ids) and ref.logprobs is not None, (
            f"{label}: request {index} has {len(got.token_ids)} tokens, the reference {len(ref.token_ids)}"
        )
        gap = top_two_gap(ref.logprobs[position])
        assert gap < NEAR_TIE, (
            f"{label}: request {index} differs at token {position}: reference "
            f"{ref.token_ids[position]} vs {got.token_ids[position]} with a top-two gap of {gap:.2e} "
            f"(not a near-tie)\nreference: {ref.token_ids}\ncandidate: {got.token_ids}"
        )
        near_ties.append(f"{label}: request {index} token {position} (gap {gap:.1e})")
    return near_ties
