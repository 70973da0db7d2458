"""spec.model.cache, pure: the claim, the pods' volume, mounts and init containers, and how a
failed fill reads in the group's failure (the cluster side: tests/e2e/test_model_cache_on_cluster.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera_operator import builders, model_cache, naming
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.builders import ClusterRef
from tessera_operator.reconcile.observe import pod_failure

REF = ClusterRef(name="c", namespace="ns", uid="u1")


def spec(cache: dict | None, **parallelism: int) -> InferenceClusterSpec:
    return InferenceClusterSpec.model_validate(
        {"model": {"source": "/m/model.gguf", "cache": cache}, "parallelism": parallelism}
    )


def test_no_cache_no_claim_and_no_init_containers() -> None:
    s = spec(None)
    assert model_cache.build_claim("c", "ns", s, {}) is None
    pod = builders.build_group(REF, s, builders.revision_of(s), 0)[0]
    assert "initContainers" not in pod["spec"]


def test_the_claim_made_defaults_to_read_write_many_and_names_the_class() -> None:
    claim = model_cache.build_claim(
        "c", "ns", spec({"storageClassName": "fast", "size": "5Gi"}), {"name": "x"}
    )
    assert claim is not None
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": "5Gi"}},
        "storageClassName": "fast",
    }
    assert model_cache.build_claim("c", "ns", spec({"claimName": "mine"}), {}) is None  # the user's


def test_leader_fills_read_write_workers_wait_and_every_rank_reads_only() -> None:
    s = spec({}, pipeline=2)
    leader, worker = builders.build_group(REF, s, builders.revision_of(s), 0)
    for pod, step, writable in ((leader, "fill", True), (worker, "wait", False)):
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes[naming.MODEL_CACHE_VOLUME]["persistentVolumeClaim"] == {"claimName": "c-model-cache"}
        (init,) = pod["spec"]["initContainers"]
        assert init["command"] == ["tessera", "model-cache", step, "/m/model.gguf"]
        assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"
        init_mount = next(m for m in init["volumeMounts"] if m["name"] == naming.MODEL_CACHE_VOLUME)
        assert init_mount["readOnly"] is (not writable)
        rank = pod["spec"]["containers"][0]
        rank_mount = next(m for m in rank["volumeMounts"] if m["name"] == naming.MODEL_CACHE_VOLUME)
        assert rank_mount == {
            "name": naming.MODEL_CACHE_VOLUME,
            "mountPath": "/model-cache",
            "readOnly": True,
        }
        assert {"name": "TESSERA_MODEL_CACHE", "value": "/model-cache"} in rank["env"]
        assert "nvidia.com/gpu" not in str(init["resources"])


def test_a_cache_changes_the_revision_and_bad_values_are_refused() -> None:
    assert builders.revision_of(spec(None)) != builders.revision_of(spec({}))
    with pytest.raises(ValidationError):
        spec({"accessModes": ["Sometimes"]})
    with pytest.raises(ValidationError):
        spec({"size": "lots"})
    with pytest.raises(ValidationError, match="claimName names an existing claim"):
        spec({"claimName": "mine", "storageClassName": "fast"})


def test_a_failed_fill_reads_as_the_init_containers_last_line() -> None:
    pod = {
        "status": {
            "phase": "Failed",
            "initContainerStatuses": [
                {
                    "name": "model-cache-fill",
                    "state": {
                        "terminated": {
                            "exitCode": 1,
                            "reason": "Error",
                            "message": "loading\nmodel-cache: fill failed: unknown model reference '/x.gguf'",
                        }
                    },
                }
            ],
            "containerStatuses": [{"name": "rank", "state": {"waiting": {"reason": "PodInitializing"}}}],
        }
    }
    assert pod_failure(pod) == (
        "InitContainerFailed: model-cache-fill Error (exit code 1): "
        "model-cache: fill failed: unknown model reference '/x.gguf'"
    )
