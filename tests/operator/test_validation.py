import pytest

from tessera_operator.validation import validate_object

BASE = {"model": {"source": "smollm2-135m-instruct"}, "parallelism": {"tensor": 2, "pipeline": 2}}


def fields(name: str, **spec_changes: object) -> list[str]:
    spec = {**BASE, **spec_changes}
    return [e.field for e in validate_object(name, spec)]


def test_valid_object_has_no_errors() -> None:
    assert fields("demo") == []
    assert fields("demo", parallelism={"tensor": 3, "pipeline": 2, "layerPartition": [16, 14]}) == []


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (
            {"parallelism": {"tensor": 1, "pipeline": 2, "layerPartition": [10, 10, 10]}},
            "spec.parallelism.layerPartition",
        ),
        (
            {"parallelism": {"tensor": 1, "pipeline": 2, "layerPartition": [16, 15]}},
            "spec.parallelism.layerPartition",
        ),
        (
            {"parallelism": {"tensor": 1, "pipeline": 2, "sequenceParallel": True}},
            "spec.parallelism.sequenceParallel",
        ),
        ({"parallelism": {"tensor": 1, "pipeline": 31}}, "spec.parallelism.pipeline"),
        ({"rollout": {"maxUnavailable": 0, "maxSurge": 0}}, "spec.rollout.maxUnavailable"),
        ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "spec.autoscaling.minReplicas"),
        (
            {"restartPolicy": {"backoffBaseSeconds": 60, "backoffMaxSeconds": 10}},
            "spec.restartPolicy.backoffBaseSeconds",
        ),
        (
            {"template": {"env": [{"name": "A", "value": "1"}, {"name": "MASTER_ADDR", "value": "x"}]}},
            "spec.template.env[1].name",
        ),
        (
            {
                "model": {"source": "x", "maxModelLen": 4096},
                "engine": {"enableChunkedPrefill": False, "maxNumBatchedTokens": 1024},
            },
            "spec.engine.maxNumBatchedTokens",
        ),
        ({"parallelism": {"tensor": 0}}, "spec.parallelism.tensor"),
    ],
)
def test_cross_field_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    assert field in fields("demo", **changes)


def test_unknown_models_skip_the_layer_count_check() -> None:
    spec = {"model": {"source": "/models/custom"}, "parallelism": {"pipeline": 2, "layerPartition": [3, 4]}}
    assert validate_object("demo", spec) == []


@pytest.mark.parametrize("name", ["0demo", "Demo", "a" * 41, "demo-"])
def test_cluster_names_must_leave_room_for_rank_hostnames(name: str) -> None:
    assert fields(name) == ["metadata.name"]
