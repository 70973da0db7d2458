"""Every parallel layout gives the greedy tokens of TP=1/PP=1: a tiny Llama whose heads split over
TP 2, and the real SmolLM2 (9 query heads, 3 KV heads, 30 layers) over TP 3.

Each layout runs as real rank processes (gloo over loopback), one process group per layout,
on concurrent requests of different lengths with chunked prefill and preemption.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera import SamplingParams
from tests.distributed.equivalence import Run, Workload, compare, run, token_prompts
from tests.engine.test_llm_greedy import prompts_of_varied_lengths

TINY_LAYOUTS = [
    {"pipeline_parallel_size": 2},
    {"pipeline_parallel_size": 3},
    {"tensor_parallel_size": 2},
    {"tensor_parallel_size": 2, "sequence_parallel": True},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 3},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "sequence_parallel": True},
]
SMOLLM2_LAYOUTS = [
    {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 3},
    {"tensor_parallel_size": 3, "sequence_parallel": True},
    {"tensor_parallel_size": 3, "pipeline_parallel_size": 2},
    {"tensor_parallel_size": 3, "pipeline_parallel_size": 2, "sequence_parallel": True},
]


def label(layout: dict[str, object]) -> str:
    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    return f"tp{tp}-pp{pp}" + ("-sp" if layout.get("sequence_parallel") else "")


# 10 requests of 3-70 tokens: prompts over the 48-token budget are prefilled in chunks, and
# 24 blocks of 16 tokens cannot hold them all at once, so the newest are preempted.
TINY_WORKLOAD = Workload(
    prompts=token_prompts(10, vocab=512, min_len=3, max_len=70),
    params=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    engine_args={"max_num_batched_tokens": 48, "num_kv_blocks": 24, "max_model_len": 160, "max_num_seqs": 16},
)
SMOLLM2_WORKLOAD = Workload(
    prompts=prompts_of_varied_lengths(),
    params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
    engine_args={"max_num_batched_tokens": 64, "num_kv_blocks": 40, "max_model_len": 256, "max_num_seqs": 16},
)


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir: Path) -> Run:
    reference = run(str(tiny_llama_dir), TINY_WORKLOAD)
    assert reference.preemptions > 0, "the workload must preempt"
    return reference


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir: Path) -> Run:
    reference = run(str(smollm2_dir), SMOLLM2_WORKLOAD)
    assert reference.preemptions > 0, "the workload must preempt"
    return reference


@pytest.mark.slow
@pytest.mark.parametrize("layout", TINY_LAYOUTS, ids=label)
def test_tiny_llama_layout_matches_single_rank(
    tiny_llama_dir: Path, tiny_reference: Run, layout: dict[str, object]
) -> None:
    result = run(str(tiny_llama_dir), TINY_WORKLOAD, **layout)
    for near_tie in compare(tiny_reference.outputs, result.outputs, label(layout)):
        print("accepted near-tie:", near_tie)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SMOLLM2_LAYOUTS, ids=label)
def test_smollm2_layout_matches_single_rank(
    smollm2_dir: Path, smollm2_reference: Run, layout: dict[str, object]
) -> None:
    result = run(str(smollm2_dir), SMOLLM2_WORKLOAD, **layout)
    for near_tie in compare(smollm2_reference.outputs, result.outputs, label(layout)):
        print("accepted near-tie:", near_tie)
