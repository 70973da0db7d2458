"""A rank's share of the model is one frozen value, read from its topology and built into the
layers: the rank tuple is not threaded through constructors by hand."""

from __future__ import annotations

import dataclasses

import pytest

from tessera.topology import SINGLE_RANK, ParallelLayout, RankPlacement, Topology, TopologyError


def test_a_topology_gives_its_rank_its_placement() -> None:
    layout = ParallelLayout(
        tensor_parallel_size=3, pipeline_parallel_size=2, sequence_parallel=True, layer_partition=[16, 14]
    )
    placement = Topology(layout=layout, tp_rank=1, pp_rank=1).placement
    assert placement == RankPlacement(
        tp_rank=1, tp_size=3, pp_rank=1, pp_size=2, layer_partition=(16, 14), sequence_parallel=True
    )
    assert placement.stage_layers(30) == (16, 30) and placement.is_last_stage and not placement.is_first_stage
    assert placement.shards_tokens
    assert Topology().placement == SINGLE_RANK and SINGLE_RANK.stage_layers(4) == (0, 4)


def test_a_placement_is_frozen_and_checks_its_ranks() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        SINGLE_RANK.tp_rank = 1  # type: ignore[misc]
    with pytest.raises(TopologyError, match="tensor-parallel rank 2 outside a group of 2"):
        RankPlacement(tp_rank=2, tp_size=2)
    with pytest.raises(TopologyError, match="pipeline rank 1 outside a pipeline of 1"):
        RankPlacement(pp_rank=1)
    assert RankPlacement(pp_size=2, layer_partition=[1, 3]).layer_partition == (1, 3)  # type: ignore[arg-type]
    assert not RankPlacement(sequence_parallel=True).shards_tokens  # one TP rank: nothing to shard
