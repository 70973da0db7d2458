"""A tiny Qwen3 (per-head query/key norms, head_dim 32 apart from hidden / heads) over every
dense layout gives the greedy tokens of TP=1/PP=1: PP 2, TP 2, TP 2 with sequence parallelism,
TP 2 x PP 2 with and without it. Real rank processes over gloo (tests/distributed/equivalence.py);
near-ties are accepted and printed.
"""

from __future__ import annotations

import pytest

from tessera import SamplingParams
from tests.distributed.equivalence import Run, Workload, compare, compare_prompt_logprobs, run, token_prompts
from tests.distributed.test_layouts_match_single_rank import label
from tests.fixtures.models import make_tiny_model_dir

LAYOUTS = [
    {"pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2},
    {"tensor_parallel_size": 2, "sequence_parallel": True},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True},
]
# 6 requests of 3-40 tokens: those over the 24-token budget are prefilled in chunks.
WORKLOAD = Workload(
    prompts=token_prompts(6, vocab=512, min_len=3, max_len=40, seed=3),
    params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    engine_args={"max_num_batched_tokens": 24, "num_kv_blocks": 32, "max_model_len": 96, "max_num_seqs": 8},
)


@pytest.fixture(scope="module")
def qwen3_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    """The model and its TP=1/PP=1 run, once for every layout."""
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("qwen3"), arch="qwen3", overrides={"head_dim": 32})
    return str(folder), run(str(folder), WORKLOAD)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[label(layout) for layout in LAYOUTS])
def test_qwen3_layout_matches_single_rank(
    qwen3_reference: tuple[str, Run], layout: dict[str, object]
) -> None:
    model, reference = qwen3_reference
    result = run(model, WORKLOAD, **layout)
    for near_tie in compare(reference.outputs, result.outputs, f"qwen3 {label(layout)}"):
        print("accepted near-tie:", near_tie)
    assert len(reference.prompt_logprobs) == len(WORKLOAD.prompts)
    compare_prompt_logprobs(reference, result, f"qwen3 {label(layout)}")
