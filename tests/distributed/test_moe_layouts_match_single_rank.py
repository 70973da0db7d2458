"""A tiny Qwen3-MoE (8 experts, top 2) gives TP=1/PP=1's greedy tokens in every layout: experts
TP-split or expert-parallel, with and without sequence parallelism and pipeline stages, over
real gloo rank processes. The expert-parallel runs report the bytes their all-to-all exchanges
moved, which must be what the rows they sent account for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tessera import SamplingParams
from tests.distributed.equivalence import Run, Workload, compare, compare_prompt_logprobs, run, token_prompts
from tests.fixtures.models import make_tiny_model_dir

HIDDEN, EXPERTS, TP = 64, 8, 2
OVERRIDES = {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 32}
# The whole matrix {tp 1, 2} x {pp 1, 2} x {sp off/on where tp > 1} x {ep off/on where tp > 1}
# (tp 1 with EP is tp 1: every expert is local); each layout costs some 10-15 s of rank
# processes on two cores.
LAYOUTS: list[dict[str, Any]] = [{"pipeline_parallel_size": 2}] + [
    {
        "tensor_parallel_size": TP,
        **({"pipeline_parallel_size": 2} if pp > 1 else {}),
        **({"sequence_parallel": True} if sp else {}),
        **({"enable_expert_parallel": True} if ep else {}),
    }
    for pp in (1, 2)
    for sp in (False, True)
    for ep in (False, True)
]
# Six requests of 3-60 tokens over a 32-token budget (chunked prefill) and 10 blocks of 16
# (preemption); few steps, since every step of a layout costs its rank processes' round trips.
WORKLOAD = Workload(
    prompts=token_prompts(6, vocab=512, min_len=3, max_len=60),
    params=SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    engine_args={"max_num_batched_tokens": 32, "num_kv_blocks": 10, "max_model_len": 128, "max_num_seqs": 8},
)
_reference: list[Run] = []


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe", overrides=OVERRIDES
    )


def label(layout: dict[str, Any]) -> str:
    tp, pp = layout.get("tensor_parallel_size", 1), layout.get("pipeline_parallel_size", 1)
    flags = [
        name
        for name, key in (("sp", "sequence_parallel"), ("ep", "enable_expert_parallel"))
        if layout.get(key)
    ]
    return "-".join([f"tp{tp}", f"pp{pp}", *flags])


def check_exchange_bytes(stats: list[dict[str, Any]], layout: dict[str, Any]) -> None:
    """Every rank's all-to-all bytes are its dispatched rows and returned outputs (hidden fp32
    values each) plus one [experts per rank] int64 count vector per peer and exchange; every row
    dispatched comes back."""
    count_bytes = (TP - 1) * (EXPERTS // TP) * 8
    for rank in stats:
        rows = rank["expert_rows_dispatched"] + rank["expert_rows_returned"]
        assert rank["expert_exchanges"] > 0 and rank["expert_rows_dispatched"] > 0
        assert rank["all_to_all_bytes_sent"] == rows * HIDDEN * 4 + rank["expert_exchanges"] * count_bytes
        steps = max(rank["steps"], 1)
        print(
            f"{label(layout)} rank {rank['rank']}: {rank['all_to_all_bytes_sent'] / steps:.0f} B/step "
            f"all-to-all ({rank['expert_rows_dispatched']} rows dispatched, "
            f"{rank['expert_rows_returned']} returned, {rank['expert_exchanges']} exchanges, {rank['steps']} steps)"
        )
    assert sum(r["expert_rows_dispatched"] for r in stats) == sum(r["expert_rows_returned"] for r in stats)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=[label(layout) for layout in LAYOUTS])
def test_moe_layout_matches_single_rank(tiny_qwen3_moe_dir: Path, layout: dict[str, Any]) -> None:
    model = str(tiny_qwen3_moe_dir)
    if not _reference:
        _reference.append(run(model, WORKLOAD))
        assert _reference[0].preemptions > 0, "the workload must preempt"
    expert_parallel = bool(layout.get("enable_expert_parallel"))
    result = run(model, WORKLOAD, comm_stats=True, **layout)
    for near_tie in compare(_reference[0].outputs, result.outputs, label(layout)):
        print("accepted near-tie:", near_tie)
    compare_prompt_logprobs(_reference[0], result, label(layout))
    if expert_parallel:
        check_exchange_bytes(result.comm_stats, layout)
    else:
        assert all(rank["all_to_all_bytes_sent"] == 0 for rank in result.comm_stats)
