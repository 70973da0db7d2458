from pathlib import Path

import pytest
import yaml

from tessera_operator import builders
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.validation import validate_object

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_pass_the_cross_field_rules(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["kind"] == "InferenceCluster"
    assert validate_object(doc["metadata"]["name"], doc["spec"]) == []


def test_gpu_example_places_one_gpu_per_rank_with_tp_on_one_node() -> None:
    doc = yaml.safe_load((EXAMPLES[0].parent / "llama-70b-gpu.yaml").read_text())
    spec = InferenceClusterSpec.model_validate(doc["spec"])
    ref = builders.ClusterRef("llama-70b", "ns", "u")
    pods = builders.build_group(ref, spec, "r", 0)
    assert len(pods) == 16
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1 for p in pods)
    assert all(
        "requiredDuringSchedulingIgnoredDuringExecution" in p["spec"]["affinity"]["podAffinity"] for p in pods
    )
