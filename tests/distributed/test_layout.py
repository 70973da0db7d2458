"""One definition of the parallel layout: the engine's flags, its configuration and the topology
environment the operator writes all go through ParallelLayout, and every error names its source."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from tessera.config import EngineConfig
from tessera.engine.arg_utils import engine_cli_args, engine_config_from_args
from tessera.entrypoints.serve_args import add_serve_args
from tessera.topology import ParallelLayout, Topology, TopologyError


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    return parser.parse_args(["model", *argv])


def test_engine_config_checks_the_partition_against_the_pipeline() -> None:
    with pytest.raises(
        ValidationError, match="layer_partition has 3 entries but pipeline_parallel_size is 2"
    ):
        EngineConfig(model="m", pipeline_parallel_size=2, layer_partition=[10, 10, 10])
    with pytest.raises(ValidationError, match="sequence_parallel needs tensor_parallel_size > 1"):
        engine_config_from_args(serve_args("--sequence-parallel"), environ={})


def test_topology_errors_name_the_environment_variable() -> None:
    with pytest.raises(TopologyError, match="TESSERA_SEQUENCE_PARALLEL needs TESSERA_TP_SIZE > 1"):
        Topology.from_env({"TESSERA_SEQUENCE_PARALLEL": "true"})
    with pytest.raises(TopologyError, match="TESSERA_LAYER_PARTITION has 3 entries"):
        Topology.from_env({"TESSERA_PP_SIZE": "2", "TESSERA_LAYER_PARTITION": "10,10,10"})


def test_a_pod_takes_its_layout_from_the_environment_and_rejects_contradicting_flags() -> None:
    layout = ParallelLayout(
        tensor_parallel_size=3, pipeline_parallel_size=2, sequence_parallel=True, layer_partition=[16, 14]
    )
    environ = Topology(layout=layout, tp_rank=1, pp_rank=1).to_env()
    config = engine_config_from_args(serve_args(), environ=environ)
    assert config.parallel == layout == Topology.from_env(environ).layout
    assert engine_config_from_args(serve_args("--tp", "3"), environ=environ).parallel == layout
    with pytest.raises(ValueError, match=r"--pipeline-parallel-size 3 contradicts .*TESSERA_PP_SIZE"):
        engine_config_from_args(serve_args("--pp", "3"), environ=environ)


def test_flags_written_by_engine_cli_args_parse_back_to_the_same_settings() -> None:
    values = {
        "max_num_seqs": 7,
        "enable_prefix_caching": False,
        "layer_partition": [3, 1],
        "kv_cache_memory": 1 << 20,
    }
    config = engine_config_from_args(serve_args(*engine_cli_args(values), "--pp", "2"), environ={})
    assert (config.max_num_seqs, config.enable_prefix_caching, config.kv_cache_memory) == (7, False, 1 << 20)
    assert config.parallel.layer_partition == [3, 1]
    with pytest.raises(KeyError):
        engine_cli_args({"no_such_setting": 1})
