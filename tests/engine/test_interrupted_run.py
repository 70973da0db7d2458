"""An offline run interrupted mid-step (Ctrl-C in the forward pass) leaves the engine clean: the
blocks the step was to write are free and never served from the prefix cache afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessera import LLM, SamplingParams


def test_a_step_interrupted_before_it_ran_poisons_no_later_request(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    prompt = list(range(3, 51))  # 6 full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    worker = llm.engine.executor.worker
    execute_model = worker.execute_model

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        worker.execute_model = execute_model  # type: ignore[method-assign]
        raise KeyboardInterrupt

    worker.execute_model = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": prompt}], greedy)
    scheduler = llm.engine.scheduler
    assert scheduler.kv.num_free_blocks == 64 and not scheduler.kv.pool.cached_blocks
    after = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    assert after.num_cached_tokens == 0
    assert llm.reset_prefix_cache()
    fresh = llm.generate([{"prompt_token_ids": prompt}], greedy)[0]
    assert after.outputs[0].token_ids == fresh.outputs[0].token_ids
