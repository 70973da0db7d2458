"""An offline call that fails midway (Ctrl-C in the forward pass, a bad prompt in a list) leaves the
engine clean: nothing of it stays queued, its blocks are free and never served afterwards."""

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


def test_a_bad_prompt_in_a_list_leaves_none_of_the_call_behind(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8, max_model_len=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": []}], greedy)
    with pytest.raises(ValueError):  # longer than the context
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [1] * 200}], greedy)
    assert not llm.engine.scheduler.requests and not llm.output_processor.requests
    (output,) = llm.generate([{"prompt_token_ids": [8, 9, 10]}], greedy)
    assert len(output.outputs[0].token_ids) == 4
    assert llm.engine.scheduler.kv.num_free_blocks == 64
