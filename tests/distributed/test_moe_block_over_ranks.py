"""Qwen2-MoE's sparse block (routed experts and the gated shared expert) over two gloo ranks, in
each of its four parallel paths (experts TP-split or expert-parallel, with and without sequence
parallelism), equals the block on one rank. The model-level layouts run Qwen3-MoE, which has
no shared expert: its partial sums join the routed rows' reduction only here."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tessera.distributed.parallel_state import ParallelGroup, set_tp_group
from tessera.models.layers.moe import MoeSpec, SparseMoeBlock
from tessera.ports import free_port
from tessera.topology import SINGLE_RANK, RankPlacement

HIDDEN, EXPERTS, TOKENS, TP = 32, 4, 7, 2  # 7 tokens: the shards pad to 8
SPEC = MoeSpec(EXPERTS, 2, 16, renormalize=False, weights_in_model_dtype=True, shared_intermediate_size=24)


class Config:
    hidden_size, hidden_act = HIDDEN, "silu"


def full_block() -> tuple[SparseMoeBlock, dict[str, torch.Tensor]]:
    """The one-rank block with seeded weights, and those weights as checkpoint tensors."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "gate": torch.randn(EXPERTS, HIDDEN, generator=generator),
        "shared_gate": torch.randn(1, HIDDEN, generator=generator),
        "shared_gate_proj": torch.randn(24, HIDDEN, generator=generator),
        "shared_up_proj": torch.randn(24, HIDDEN, generator=generator),
        "shared_down_proj": torch.randn(HIDDEN, 24, generator=generator),
    }
    for e in range(EXPERTS):
        for part, shape in (
            ("gate_proj", (16, HIDDEN)),
            ("up_proj", (16, HIDDEN)),
            ("down_proj", (HIDDEN, 16)),
        ):
            tensors[f"{e}.{part}"] = torch.randn(*shape, generator=generator) * 0.5
    return load(SINGLE_RANK, tensors), tensors


def load(placement: RankPlacement, tensors: dict[str, torch.Tensor]) -> SparseMoeBlock:
    block = SparseMoeBlock(Config(), SPEC, torch.float32, placement)
    assert block.shared_expert is not None and block.shared_expert_gate is not None
    with torch.no_grad():
        block.gate.weight.copy_(tensors["gate"])
        block.shared_expert_gate.weight.copy_(tensors["shared_gate"])
        gate_up = block.shared_expert.gate_up_proj
        gate_up.weight_loader(gate_up.weight, tensors["shared_gate_proj"], 0)
        gate_up.weight_loader(gate_up.weight, tensors["shared_up_proj"], 1)
        down = block.shared_expert.down_proj
        down.weight_loader(down.weight, tensors["shared_down_proj"])
        for e in range(EXPERTS):
            if block.experts.holds(e):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    block.experts.load_expert(e, part, tensors[f"{e}.{part}"])
    return block


def rank_main(rank: int, port: int, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    set_tp_group(ParallelGroup(tuple(range(TP)), rank, dist.group.WORLD))
    try:
        reference, tensors = full_block()
        x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
        want = reference(x)
        for sp in (False, True):
            for ep in (False, True):
                block = load(
                    RankPlacement(tp_rank=rank, tp_size=TP, sequence_parallel=sp, expert_parallel=ep), tensors
                )
                with torch.no_grad():
                    if sp:  # this rank's shard of the padded rows in, its shard out
                        rows = (TOKENS + 1) // TP
                        padded = torch.cat([x, x.new_zeros(1, HIDDEN)])
                        got = block(padded[rank * rows : (rank + 1) * rows])
                        expected = torch.cat([want, want.new_zeros(1, HIDDEN)])[
                            rank * rows : (rank + 1) * rows
                        ]
                        got, expected = got[: TOKENS - rank * rows], expected[: TOKENS - rank * rows]
                    else:
                        got, expected = block(x), want
                # Relative to the output's scale: the partial sums add in another order (fp32).
                results.put((rank, sp, ep, float((got - expected).abs().max() / want.abs().max())))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_shared_expert_block_matches_one_rank_in_every_path() -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(rank, port, results)) for rank in range(TP)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    diffs = [results.get(timeout=5) for _ in range(TP * 4)]
    print(diffs)
    assert sorted((rank, sp, ep) for rank, sp, ep, _ in diffs) == [
        (rank, sp, ep) for rank in range(TP) for sp in (False, True) for ep in (False, True)
    ]
    assert all(diff < 1e-6 for *_, diff in diffs), diffs
