"""The arithmetic of the memory bounds, without a server: what counts against each cap."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from tessera.entrypoints.limits import ServingLimits
from tessera.entrypoints.serving_common import default_max_waiting_requests
from tessera.sampling_params import InvalidParameterError, SamplingParams


def test_prompt_logprob_entries_count_prompts_positions_logprobs_and_n() -> None:
    limits = ServingLimits(max_prompt_logprobs_entries=1000)
    params = SamplingParams(max_tokens=1, logprobs=9, n=2)
    params.prompt_logprobs = 9
    limits.check_prompt_logprobs(params, [25, 25])  # 50 x 10 x 2 = 1000: at the cap
    with pytest.raises(InvalidParameterError) as refused:
        limits.check_prompt_logprobs(params, [25, 26])
    assert refused.value.param == "logprobs"
    assert "1000" in str(refused.value) and "--max-prompt-logprobs-entries" in str(refused.value)
    limits.check_prompt_logprobs(SamplingParams(max_tokens=1, logprobs=9), [10**6])  # no echo: nothing scored


@pytest.mark.parametrize(
    ("ready_info", "expected"),
    [
        ({"num_kv_blocks": 1000, "block_size": 16}, 500),  # 4 x 16,000 tokens / 128 per sequence
        ({"num_kv_blocks": 10, "block_size": 16}, 32),  # never below 4 x --max-num-seqs
        ({}, 32),  # a core that does not report its cache
    ],
)
def test_default_waiting_room_is_the_kv_capacity_in_full_sequences(
    ready_info: dict[str, int], expected: int
) -> None:
    from tessera.engine.async_llm import AsyncLLM

    engine = SimpleNamespace(
        core=SimpleNamespace(ready_info=ready_info),
        max_model_len=128,
        config=SimpleNamespace(max_num_seqs=8),
    )
    engine.kv_capacity_sequences = AsyncLLM.kv_capacity_sequences.fget(engine)  # type: ignore[attr-defined]
    assert default_max_waiting_requests(cast(Any, engine)) == expected
