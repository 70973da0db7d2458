"""Sequence parallelism with pipeline parallelism: each TP rank sends only its shard of the tokens
across the stage boundary, exactly 1/tp of the bytes it sends without SP (counted by the runtime),
and both give TP 1 / PP 1's tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessera import LLM, SamplingParams
from tests.distributed import equivalence
from tests.distributed.equivalence import Workload

TP, PP = 2, 2
# Four requests of eight tokens: with two batches in flight every step carries an even number of
# tokens (prefills of 16, decodes of 2), so a shard is exactly half of the batch.
PROMPTS = [{"prompt_token_ids": [10 + i, 20, 30, 40, 50, 60, 70, 80]} for i in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def single_rank_tokens(model: Path) -> list[list[int]]:
    reference = equivalence.run(
        str(model), Workload(PROMPTS, PARAMS, {"num_kv_blocks": 32, "max_model_len": 128})
    )
    return [output.token_ids for output in reference.outputs]


def run(model: Path, sequence_parallel: bool) -> tuple[list[list[int]], list[dict[str, Any]]]:
    llm = LLM(
        str(model),
        tensor_parallel_size=TP,
        pipeline_parallel_size=PP,
        sequence_parallel=sequence_parallel,
        num_kv_blocks=32,
        max_model_len=128,
    )
    try:
        executor = llm.engine.executor
        executor.collective_rpc("reset_comm_stats")
        tokens = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, PARAMS)]
        return tokens, executor.collective_rpc("comm_stats")
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
def test_each_tp_rank_sends_one_tp_th_of_the_activations(tiny_llama_dir: Path) -> None:
    tokens_off, stats_off = run(tiny_llama_dir, sequence_parallel=False)
    tokens_sp, stats_sp = run(tiny_llama_dir, sequence_parallel=True)
    assert tokens_off == single_rank_tokens(tiny_llama_dir)
    assert tokens_sp == tokens_off
    first_stage = range(TP)  # the ranks that send across the boundary
    for rank in first_stage:
        sent_off, sent_sp = stats_off[rank]["p2p_bytes_sent"], stats_sp[rank]["p2p_bytes_sent"]
        assert sent_off > 0 and stats_off[rank]["steps"] == stats_sp[rank]["steps"]
        assert sent_sp * TP == sent_off, f"rank {rank}: {sent_sp} bytes with SP, {sent_off} without"
    for rank in range(TP, TP * PP):  # the last stage sends nothing, and receives what was sent
        assert stats_sp[rank]["p2p_bytes_sent"] == 0
        assert stats_sp[rank]["p2p_bytes_received"] == stats_sp[rank - TP]["p2p_bytes_sent"]
