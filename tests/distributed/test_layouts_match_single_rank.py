"""Every parallel layout gives the greedy tokens of TP=1/PP=1: a tiny Llama whose heads split over
TP 2, and the real SmolLM2 (9 query heads, 3 KV heads, 30 layers) over TP 3.

Each layout runs as real rank processes (gloo over loopback), one process group per layout,
on concurrent requests of different lengths with chunked prefill and preemption.
"""

from __future__ import annotations

import pytest

from tessera import SamplingParams
from tests.distributed.equivalence import Run, Workload, compare, compare_prompt_logprobs, run, token_prompts
from tests.engine.test_llm_greedy import prompts_of_varied_lengths

# TP x PP runs with three stages and SP, so a middle stage both receives and sends sequence
# shards; without SP a middle stage passes whole activations, as PP 3 alone checks, and TP 2 x
# PP 2 with and without SP is checked against TP 1 / PP 1 by test_sequence_parallel_traffic.
# (TP 2 x PP 3 without SP took 50 s of six rank processes on two cores for no path of its own.)
TINY_LAYOUTS = [
    {"pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 3},
    {"tensor_parallel_size": 2},
    {"tensor_parallel_size": 2, "sequence_parallel": True},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "sequence_parallel": True},
]
# The real model's heads over TP 3 and its layers over PP 2. Both together with sequence
# parallelism is the demo's layout, which tests/e2e checks against one process on the cluster
# (here it took six SmolLM2 processes on two cores over two minutes, and checked nothing more).
SMOLLM2_LAYOUTS = [
    {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 3},
    {"tensor_parallel_size": 3, "sequence_parallel": True},
]


def label(layout: dict[str, object]) -> str:
    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    return f"tp{tp}-pp{pp}" + ("-sp" if layout.get("sequence_parallel") else "")


# 10 requests of 3-70 tokens: prompts over the 48-token budget are prefilled in chunks, and
# 24 blocks of 16 tokens cannot hold them all at once, so the newest are preempted.
TINY_WORKLOAD = Workload(
    prompts=token_prompts(10, vocab=512, min_len=3, max_len=70),
    params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    engine_args={"max_num_batched_tokens": 48, "num_kv_blocks": 24, "max_model_len": 160, "max_num_seqs": 16},
)
SMOLLM2_WORKLOAD = Workload(
    prompts=prompts_of_varied_lengths(),
    params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
    engine_args={"max_num_batched_tokens": 64, "num_kv_blocks": 14, "max_model_len": 128, "max_num_seqs": 16},
)


CASES = [("tiny_llama_dir", TINY_WORKLOAD, layout) for layout in TINY_LAYOUTS] + [
    ("smollm2_dir", SMOLLM2_WORKLOAD, layout) for layout in SMOLLM2_LAYOUTS
]
_references: dict[str, Run] = {}


def reference_for(model: str, workload: Workload) -> Run:
    """TP=1/PP=1 on the same workload, once per model (every layout of that model compares to it)."""
    if model not in _references:
        reference = run(model, workload)
        assert reference.preemptions > 0, "the workload must preempt"
        _references[model] = reference
    return _references[model]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_fixture", "workload", "layout"),
    CASES,
    ids=[f"{fixture.split('_')[0]}-{label(layout)}" for fixture, _, layout in CASES],
)
def test_layout_matches_single_rank(
    request: pytest.FixtureRequest, model_fixture: str, workload: Workload, layout: dict[str, object]
) -> None:
    model = str(request.getfixturevalue(model_fixture))
    result = run(model, workload, **layout)
    reference = reference_for(model, workload)
    for near_tie in compare(reference.outputs, result.outputs, label(layout)):
        print("accepted near-tie:", near_tie)
    if workload.params.prompt_logprobs is not None:
        assert len(reference.prompt_logprobs) == len(workload.prompts)
        compare_prompt_logprobs(reference, result, label(layout))
