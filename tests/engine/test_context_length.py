"""The context a model's positions cover bounds max_model_len: past it a clear error at start-up,
never a crash of the engine when a long prompt arrives."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera import LLM, SamplingParams
from tests.engine.reference import hf_greedy
from tests.fixtures.models import make_tiny_model_dir

LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}


def test_max_model_len_past_the_models_positions_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path / "plain", max_position=64)
    with pytest.raises(ValueError, match="max_model_len=256 is longer than the model's context of 64"):
        LLM(str(folder), max_model_len=256, num_kv_blocks=32)


def test_a_linear_rope_scaling_stretches_the_context(tmp_path: Path) -> None:
    # 64 positions scaled by 4: a 100-token prompt is in range, and matches transformers token for token.
    folder = make_tiny_model_dir(tmp_path / "linear", max_position=64, rope_parameters=LINEAR_ROPE)
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=32)
    assert llm.engine.max_model_len == 256
    prompt = [(7 * i) % 400 + 3 for i in range(100)]
    output = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )
    assert output[0].outputs[0].token_ids == hf_greedy(folder, [prompt], 8, None)[0]
