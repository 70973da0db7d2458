import json
from typing import Any

import pytest
from pydantic import ValidationError

from tessera_operator import api, bounded_json
from tessera_operator.admission.podpolicy import PodPolicy
from tessera_operator.admission.validation import validate_object

BASE = {"model": {"source": "smollm2-135m-instruct"}, "parallelism": {"tensor": 3, "pipeline": 2}}


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
        (  # the operator's autoscaler reads tessera:num_requests_waiting
            {"autoscaling": {"enabled": True, "maxReplicas": 2}, "engine": {"metricsPrefix": "vllm"}},
            "spec.engine.metricsPrefix",
        ),
        (  # scale to zero needs the router (it counts the requests at zero)
            {"autoscaling": {"enabled": True, "minReplicas": 0}, "router": {"enabled": False}},
            "spec.autoscaling.minReplicas",
        ),
        ({"template": {"imagePullSecrets": ["Not A Name"]}}, "spec.template.imagePullSecrets[0]"),
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
        # What the runtime would refuse in every rank once loaded: SmolLM2-135M has 9 query heads,
        # 3 key/value heads and a 1,536-wide MLP.
        ({"parallelism": {"tensor": 2, "pipeline": 2}}, "spec.parallelism.tensor"),
        ({"parallelism": {"tensor": 9}}, "spec.parallelism.tensor"),
        ({"model": {"source": "smollm2-135m-instruct", "maxModelLen": 1}}, "spec.model.maxModelLen"),
    ],
)
def test_cross_field_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    assert field in fields("demo", **changes)


def test_unknown_models_skip_the_layer_count_check() -> None:
    spec = {"model": {"source": "/models/custom"}, "parallelism": {"pipeline": 2, "layerPartition": [3, 4]}}
    assert validate_object("demo", spec) == []


@pytest.mark.parametrize(
    ("source", "tensor"),
    [
        ("smollm2-135m-instruct", 3),  # one KV head a rank
        ("/models/Llama-3.1-70B-Instruct", 8),
        ("meta-llama/Llama-3.1-70B-Instruct", 16),  # 8 KV heads, each whole on 2 ranks
        ("llama-3.1-8b-instruct", 2),
    ],
)
def test_tensor_sizes_the_model_splits_over_pass(source: str, tensor: int) -> None:
    assert validate_object("demo", {"model": {"source": source}, "parallelism": {"tensor": tensor}}) == []


def test_the_tensor_error_says_what_does_not_split() -> None:
    errors = validate_object(
        "demo", {"model": {"source": "smollm2-360m-instruct"}, "parallelism": {"tensor": 2}}
    )
    assert [(e.field, e.message) for e in errors] == [
        (
            "spec.parallelism.tensor",
            "15 attention heads do not split over 2 ranks (model 'smollm2-360m-instruct')",
        )
    ]


@pytest.mark.parametrize("name", ["0demo", "Demo", "a" * 41, "demo-"])
def test_cluster_names_must_leave_room_for_rank_hostnames(name: str) -> None:
    assert fields(name) == ["metadata.name"]


HOST_PATH = {"name": "node", "hostPath": {"path": "/"}}
SECRET_ENV = {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}
TOKEN = {"name": "tok", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"replicas": 100_000}, "spec.replicas"),  # the schema's maximum
        ({"replicas": 1, "parallelism": {"tensor": 64, "pipeline": 64}}, "spec.replicas"),  # 4,096 pods
        ({"replicas": 65, "parallelism": {"tensor": 8, "pipeline": 2}}, "spec.replicas"),  # 1,040 > 1,024
        (
            {
                "parallelism": {"tensor": 8, "pipeline": 2},
                "autoscaling": {"enabled": True, "maxReplicas": 200},
            },
            "spec.autoscaling.maxReplicas",
        ),
        (
            {"replicas": 60, "parallelism": {"tensor": 8, "pipeline": 2}, "rollout": {"maxSurge": 20}},
            "spec.rollout.maxSurge",
        ),
        ({"engine": {"kvCacheMemory": "1e400"}}, "spec.engine.kvCacheMemory"),
        ({"engine": {"kvCacheMemory": "1e999999999999999"}}, "spec.engine.kvCacheMemory"),
        # Admitted, each would crash-loop every leader (the engine needs at least one byte).
        ({"engine": {"kvCacheMemory": 0}}, "spec.engine.kvCacheMemory"),
        ({"engine": {"kvCacheMemory": "0"}}, "spec.engine.kvCacheMemory"),
        ({"engine": {"kvCacheMemory": "100m"}}, "spec.engine.kvCacheMemory"),
        (
            {"template": {"resources": {"limits": {"memory": "1e400"}}}},
            "spec.template.resources.limits[memory]",
        ),
        ({"template": {"resources": {"limits": {"cpu": "lots"}}}}, "spec.template.resources.limits[cpu]"),
        ({"template": {"resources": {"request": {"cpu": "1"}}}}, "spec.template.resources.request"),
        (
            {"template": {"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1"}}}},
            "spec.template.resources.requests[cpu]",
        ),
        ({"template": {"serviceAccountName": "admin"}}, "spec.template.serviceAccountName"),
        ({"template": {"priorityClassName": "system-node-critical"}}, "spec.template.priorityClassName"),
        ({"template": {"volumes": [HOST_PATH]}}, "spec.template.volumes[0].hostPath"),
        # Volume types outside the restricted profile: the node mounts or runs them for the author.
        (
            {"template": {"volumes": [{"name": "g", "gitRepo": {"repository": "https://x/y.git"}}]}},
            "spec.template.volumes[0].gitRepo",
        ),
        (
            {"template": {"volumes": [{"name": "n", "nfs": {"server": "10.0.0.1", "path": "/"}}]}},
            "spec.template.volumes[0].nfs",
        ),
        (
            {
                "template": {
                    "volumes": [{"name": "f", "flexVolume": {"driver": "x", "secretRef": {"name": "s"}}}]
                }
            },
            "spec.template.volumes[0].flexVolume",
        ),
        (
            {
                "template": {
                    "volumes": [{"name": "c", "csi": {"driver": "d", "nodePublishSecretRef": {"name": "s"}}}]
                }
            },
            "spec.template.volumes[0].csi.nodePublishSecretRef",
        ),
        (
            {
                "template": {
                    "volumes": [{"name": "p", "projected": {"sources": [{"clusterTrustBundle": {}}]}}]
                }
            },
            "spec.template.volumes[0].projected.sources[0].clusterTrustBundle",
        ),
        ({"template": {"env": [SECRET_ENV]}}, "spec.template.env[0].valueFrom.secretKeyRef"),
        (
            {"template": {"volumes": [{"name": "s", "secret": {"secretName": "s"}}]}},
            "spec.template.volumes[0].secret",
        ),
        (
            {"template": {"volumes": [TOKEN]}},
            "spec.template.volumes[0].projected.sources[0].serviceAccountToken",
        ),
        (
            {
                "template": {
                    "annotations": {"container.apparmor.security.beta.kubernetes.io/rank": "unconfined"}
                }
            },
            "spec.template.annotations[container.apparmor.security.beta.kubernetes.io/rank]",
        ),
        ({"template": {"labels": {"team": "a b"}}}, "spec.template.labels[team]"),
        ({"template": {"labels": {"tessera.dev/group": "7"}}}, "spec.template.labels[tessera.dev/group]"),
        (
            {"template": {"annotations": {"tessera.dev/group-size": "1"}}},
            "spec.template.annotations[tessera.dev/group-size]",
        ),
        ({"template": {"nodeSelector": {"bad key": "x"}}}, "spec.template.nodeSelector[bad key]"),
        ({"template": {"image": "registry/runtime cpu:1"}}, "spec.template.image"),
        ({"template": {"env": [{"name": "A B", "value": "1"}]}}, "spec.template.env[0].name"),
        ({"template": {"env": [{"name": f"V{i}", "value": "1"} for i in range(300)]}}, "spec.template.env"),
        ({"template": {"gpuResourceName": "nvidia gpu"}}, "spec.template.gpuResourceName"),
        ({"template": {"gpuResourceName": "gpu"}}, "spec.template.gpuResourceName"),
        ({"template": {"gpuResourceName": "kubernetes.io/gpu"}}, "spec.template.gpuResourceName"),
        # The API server's container resource rules.
        (
            {"template": {"resources": {"limits": {"memroy": "1Gi"}}}},
            "spec.template.resources.limits[memroy]",
        ),
        (
            {"template": {"resources": {"limits": {"example.com/fpga": "500m"}}}},
            "spec.template.resources.limits[example.com/fpga]",
        ),
        (
            {"template": {"resources": {"requests": {"example.com/fpga": "1"}}}},
            "spec.template.resources.requests[example.com/fpga]",
        ),
        (
            {
                "template": {
                    "resources": {"requests": {"example.com/fpga": 1}, "limits": {"example.com/fpga": 2}}
                }
            },
            "spec.template.resources.requests[example.com/fpga]",
        ),
        (
            {"template": {"resources": {"requests": {"hugepages-2Mi": "2Mi"}, "limits": {"memory": "1Gi"}}}},
            "spec.template.resources.requests[hugepages-2Mi]",
        ),
        (
            {"template": {"tolerations": [{"key": "team", "operator": "Equal", "value": "a b"}]}},
            "spec.template.tolerations[0].value",
        ),
        (
            {"template": {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}},
            "spec.template.tolerations[0].key",
        ),
        (
            {
                "template": {
                    "tolerations": [
                        {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}
                    ]
                }
            },
            "spec.template.tolerations[0].effect",
        ),
        ({"placement": {"topologyKey": "-zone"}}, "spec.placement.topologyKey"),
        ({"model": {"source": "--api-key=stolen"}}, "spec.model.source"),
        ({"template": {"volumes": [{"name": "dshm", "emptyDir": {}}]}}, "spec.template.volumes[0].name"),
        (
            {"template": {"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}},
            "spec.template.volumeMounts[0].name",
        ),
        ({"restartPolicy": {"backoffMaxSeconds": 1e308}}, "spec.restartPolicy.backoffMaxSeconds"),
        # Kubernetes' own pod rules: each of these would fail every pod create with a 422.
        (
            {
                "template": {
                    "env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]
                }
            },
            "spec.template.env[0].valueFrom",
        ),
        ({"template": {"env": [{"name": "A", "valueFrom": {}}]}}, "spec.template.env[0].valueFrom"),
        ({"template": {"volumes": [{"name": "a"}]}}, "spec.template.volumes[0]"),
        (
            {"template": {"volumes": [{"name": "a", "emptyDir": {}, "configMap": {}}]}},
            "spec.template.volumes[0]",
        ),
        ({"template": {"volumes": [{"emptyDir": {}}]}}, "spec.template.volumes[0].name"),
        ({"template": {"volumes": [{"name": "Cache_1", "emptyDir": {}}]}}, "spec.template.volumes[0].name"),
        (
            {"template": {"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a"}]}},
            "spec.template.volumeMounts[0].mountPath",
        ),
        (
            {"template": {"tolerations": [{"key": "k", "operator": "Bogus"}]}},
            "spec.template.tolerations[0].operator",
        ),
        (
            {"template": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
            "spec.template.tolerations[0].value",
        ),
        (
            {"template": {"tolerations": [{"key": "k", "effect": "Never"}]}},
            "spec.template.tolerations[0].effect",
        ),
        ({"template": {"affinity": {"nodeAffinity": "x"}}}, "spec.template.affinity.nodeAffinity"),
        ({"template": {"affinity": {"zoneAffinity": {}}}}, "spec.template.affinity.zoneAffinity"),
    ],
)
def test_what_would_fail_or_escalate_in_the_pods_is_rejected_naming_the_field(
    changes: dict[str, object], field: str
) -> None:
    assert field in fields("demo", **changes)


def test_the_restricted_profiles_volume_types_pass() -> None:
    volumes = [
        {"name": "e", "emptyDir": {}},
        {"name": "c", "configMap": {"name": "cfg"}},
        {"name": "d", "downwardAPI": {"items": []}},
        {"name": "m", "persistentVolumeClaim": {"claimName": "models"}},
        {"name": "x", "ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
        {"name": "i", "csi": {"driver": "d"}},
        {"name": "p", "projected": {"sources": [{"configMap": {"name": "cfg"}}, {"downwardAPI": {}}]}},
    ]
    assert fields("demo", template={"volumes": volumes}) == []


def test_valid_pod_fields_pass() -> None:
    template = {
        "env": [
            {"name": "A", "value": "1"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "EMPTY", "value": "", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "resources": {
            "requests": {"cpu": "2", "memory": "4Gi", "example.com/fpga": 1, "hugepages-2Mi": "64Mi"},
            "limits": {"cpu": "4", "memory": "8Gi", "example.com/fpga": "1", "hugepages-2Mi": "64Mi"},
        },
        "tolerations": [
            {
                "key": "node.kubernetes.io/unreachable",
                "operator": "Exists",
                "effect": "NoExecute",
                "tolerationSeconds": 30,
            },
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "team", "operator": "Equal", "value": "ml"},
            {"key": "spot", "value": "true"},
            {"operator": "Exists", "effect": "NoExecute"},  # every NoExecute taint: not the control plane's
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
                }
            }
        },
    }
    assert fields("demo", template=template) == []


def test_the_operators_configuration_opens_each_restriction() -> None:
    spec = {
        "model": {"source": "/models/custom"},
        "parallelism": {"tensor": 64, "pipeline": 64},
        "template": {
            "serviceAccountName": "inference",
            "priorityClassName": "high",
            "env": [SECRET_ENV],
            "volumes": [HOST_PATH, TOKEN, {"name": "s", "secret": {"secretName": "s"}}],
        },
    }
    assert len(validate_object("demo", spec)) == 7
    policy = PodPolicy(
        allow_host_path=True,
        allow_secrets=True,
        allowed_service_accounts=frozenset({"inference"}),
        allowed_priority_classes=frozenset({"high"}),
        max_pods_per_cluster=4096,
    )
    assert validate_object("demo", spec, policy) == []


def test_named_secrets_can_be_allowed_without_opening_every_secret() -> None:
    """The API key's Secret, say: --allowed-secrets opens it where a spec can name a Secret."""

    def spec_naming(secret: str) -> dict[str, object]:
        env = {"name": "TESSERA_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": "key"}}}
        volumes = [
            {"name": "v", "secret": {"secretName": secret}},
            {"name": "p", "projected": {"sources": [{"secret": {"name": secret}}]}},
            {"name": "c", "csi": {"driver": "d", "nodePublishSecretRef": {"name": secret}}},
        ]
        return {"model": {"source": "smollm2-135m-instruct"}, "template": {"env": [env], "volumes": volumes}}

    policy = PodPolicy(allowed_secrets=frozenset({"api-key"}))
    assert validate_object("demo", spec_naming("api-key"), policy) == []
    refused = [e.field for e in validate_object("demo", spec_naming("db-password"), policy)]
    assert refused == [
        "spec.template.env[0].valueFrom.secretKeyRef",
        "spec.template.volumes[0].secret",
        "spec.template.volumes[1].projected.sources[0].secret",
        "spec.template.volumes[2].csi.nodePublishSecretRef",
    ]


def test_the_largest_cluster_within_the_cap_passes() -> None:
    layout = {"tensor": 8, "pipeline": 2}
    assert (
        fields("demo", model={"source": "llama-3.1-8b-instruct"}, replicas=64, parallelism=layout) == []
    )  # 1,024 pods


@pytest.mark.parametrize(
    ("template", "field"),
    [
        ({"volumes": [{"name": "s", "secret": {"secretName": ["k"]}}]}, "spec.template.volumes[0].secret"),
        (
            {"env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": ["k"], "key": "x"}}}]},
            "spec.template.env[0].valueFrom.secretKeyRef",
        ),
        ({"volumes": [{"name": ["a"], "emptyDir": {}}]}, "spec.template.volumes[0].name"),
        (
            {
                "volumes": [{"name": "a", "emptyDir": {}}],
                "volumeMounts": [{"name": ["a"], "mountPath": "/a"}],
            },
            "spec.template.volumeMounts[0].name",
        ),
        ({"volumes": [{"name": "p", "projected": "x"}]}, "spec.template.volumes[0].projected"),
        ({"volumes": [{"name": "e", "emptyDir": "x"}]}, "spec.template.volumes[0].emptyDir"),
        (
            {"volumes": [{"name": "p", "projected": {"sources": ["secret"]}}]},
            "spec.template.volumes[0].projected.sources[0]",
        ),
    ],
)
def test_free_form_values_of_the_wrong_json_type_are_errors_naming_the_field(
    template: dict[str, object], field: str
) -> None:
    """The CRD stores any JSON in the pod's free-form fields: a wrong type is refused, never a crash
    (which would stop the reconciler from repairing the cluster and the webhook from naming it)."""
    assert field in fields("demo", template=template)


@pytest.mark.parametrize(
    "changes",
    [
        {"template": {"labels": {"team": "ml\n"}}},
        {"template": {"nodeSelector": {"gpu": "a100\n"}}},
        {"template": {"annotations": {"note\n": "x"}}},
        {"template": {"tolerations": [{"key": "dedicated\n", "operator": "Exists"}]}},
        {"template": {"volumes": [{"name": "e\n", "emptyDir": {}}]}},
        {"placement": {"topologyKey": "kubernetes.io/hostname\n"}},
    ],
)
def test_a_trailing_newline_is_not_a_valid_name_or_label(changes: dict[str, object]) -> None:
    """A YAML block scalar ends in a newline; the API server refuses it in every pod."""
    assert fields("demo", **changes)


def test_a_rule_that_breaks_on_an_unforeseen_value_refuses_the_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera_operator.admission import validation

    def broken(*_: object) -> list[object]:
        raise TypeError("unhashable type: 'list'")

    monkeypatch.setattr(validation, "validate_template", broken)
    errors = validate_object("demo", dict(BASE))
    assert [(e.field, e.message) for e in errors] == [
        ("spec", "cannot be checked: TypeError: unhashable type: 'list'")
    ]


def test_a_known_models_context_and_kv_cache_are_checked_before_any_rank_loads_it() -> None:
    """The runtime refuses both in every rank, after loading: a maxModelLen past the model's
    context (8,192 tokens for SmolLM2), and a cache smaller than one sequence of maxModelLen."""
    model = {"source": "smollm2-135m-instruct"}
    assert fields("demo", model={**model, "maxModelLen": 16384}) == ["spec.model.maxModelLen"]
    assert fields("demo", model={**model, "maxModelLen": 8192}) == []
    # 3 x 2 ranks: 15 layers and one KV head of 64 each, at least 2 bytes an element, so at least
    # 3,840 bytes a token: 1Mi holds 273 tokens (17 blocks); 2,048 tokens need 128 blocks.
    for too_small in ("1", "1Mi"):
        changes = {"model": {**model, "maxModelLen": 2048}, "engine": {"kvCacheMemory": too_small}}
        assert fields("demo", **changes) == ["spec.engine.kvCacheMemory"]
    enough = {"model": {**model, "maxModelLen": 2048}, "engine": {"kvCacheMemory": str(3840 * 2048)}}
    assert fields("demo", **enough) == []
    # Without maxModelLen the runtime holds a whole context (8,192 tokens): 8Mi is too little.
    assert fields("demo", model=model, engine={"kvCacheMemory": "8Mi"}) == ["spec.engine.kvCacheMemory"]
    # A model the operator does not know is left to the runtime.
    assert (
        fields("demo", model={"source": "org/unknown", "maxModelLen": 10**6}, engine={"kvCacheMemory": "1"})
        == []
    )


def deep(levels: int) -> dict[str, Any]:
    """`{"a": {"a": ...}}`, `levels` objects deep, built without recursion."""
    value: dict[str, Any] = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize("levels", [33, 300, 1500, 100_000])
@pytest.mark.parametrize(
    ("template", "field"),
    [
        (lambda v: {"affinity": v}, "spec.template.affinity"),
        (lambda v: {"resources": v}, "spec.template.resources"),
        (lambda v: {"tolerations": [v]}, "spec.template.tolerations"),
        (lambda v: {"volumes": [{"name": "v", "emptyDir": v}]}, "spec.template.volumes"),
        (lambda v: {"volumeMounts": [v]}, "spec.template.volumeMounts"),
        (lambda v: {"env": [{"name": "A", "valueFrom": v}]}, "spec.template.env[0].valueFrom"),
    ],
)
def test_a_free_form_field_nested_too_deep_is_refused_naming_it(
    levels: int, template: Any, field: str
) -> None:
    """Past 254 levels hashing a revision raised, past about 1000 Python's JSON decoder does: the
    model itself refuses any free-form field deeper than 32 (the reconciler's parse included)."""
    errors = validate_object("demo", {**BASE, "template": template(deep(levels))})
    assert [str(e) for e in errors] == [f"{field}: nests deeper than {api.MAX_FREE_FORM_DEPTH} levels"]
    with pytest.raises(ValidationError, match="nests deeper than 32 levels"):
        api.InferenceClusterSpec.model_validate({**BASE, "template": template(deep(levels))})


def test_free_form_fields_are_bounded_in_size_and_pass_at_their_depth() -> None:
    big = [{"key": f"k{i}", "operator": "Exists", "effect": "NoExecute", "x": "y" * 1024} for i in range(64)]
    assert [str(e) for e in validate_object("demo", {**BASE, "template": {"tolerations": big}})] == [
        f"spec.template.tolerations: is larger than {api.MAX_FREE_FORM_BYTES} bytes"
    ]
    # 32 levels, counting the field's own object, pass (the API server's pod validation judges them).
    assert api.TemplateSpec.model_validate({"affinity": deep(api.MAX_FREE_FORM_DEPTH)}).affinity is not None


def test_bounded_json_measures_without_recursion() -> None:
    value: Any = 1
    for _ in range(200_000):
        value = [value]
    assert bounded_json.excess(value, 32, 2**62) == ("depth", [0] * 32)
    assert bounded_json.excess({"a": [1, "x"]}, 2, 1000) is None
    assert bounded_json.excess({"a": [1, "x"]}, 1, 1000) == ("depth", ["a"])
    compact = json.dumps({"a": [1, "x", None, True], "b": {"c": 1.5}}, separators=(",", ":"))
    value = {"a": [1, "x", None, True], "b": {"c": 1.5}}
    # At most a byte per container over the compact JSON (a comma counted after each last item).
    assert bounded_json.excess(value, 8, len(compact) + 3) is None
    assert bounded_json.excess(value, 8, len(compact) - 1) is not None
    assert bounded_json.excess({"a": "x" * 100}, 8, 50) == ("size", ["a"])


def test_image_pull_secrets_follow_the_secret_policy() -> None:
    spec = {**BASE, "template": {"imagePullSecrets": ["registry-creds", "other"]}}
    assert [str(e) for e in validate_object("demo", spec)] == [
        f"spec.template.imagePullSecrets[{i}]: pulling the image with Secret {name!r} is not allowed by "
        "the operator's configuration (--allowed-secrets NAME or --allow-secrets)"
        for i, name in enumerate(["registry-creds", "other"])
    ]
    named = PodPolicy(allowed_secrets=frozenset({"registry-creds"}))
    assert [e.field for e in validate_object("demo", spec, named)] == ["spec.template.imagePullSecrets[1]"]
    assert validate_object("demo", spec, PodPolicy(allow_secrets=True)) == []


CONTROL_PLANE = "node-role.kubernetes.io/control-plane"
MASTER = "node-role.kubernetes.io/master"


def test_rank_pods_cannot_target_control_plane_nodes_unless_allowed() -> None:
    def term(key: str, operator: str) -> dict[str, Any]:
        return {"matchExpressions": [{"key": key, "operator": operator}]}

    template = {
        "nodeSelector": {CONTROL_PLANE: "", "gpu": "a100"},
        "tolerations": [
            {"key": CONTROL_PLANE, "operator": "Exists", "effect": "NoSchedule"},
            {"key": MASTER, "operator": "Exists"},
            {"operator": "Exists"},  # tolerates every taint, the control plane's too
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": MASTER, "operator": "Exists", "effect": "NoExecute"},  # not the NoSchedule taint
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [term("gpu", "Exists"), term(MASTER, "Exists")]
                },
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 1, "preference": term(CONTROL_PLANE, "In") | {}},
                    {"weight": 1, "preference": term(CONTROL_PLANE, "DoesNotExist")},  # keeps away: fine
                ],
            }
        },
    }
    template["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"][
        "matchExpressions"
    ][0]["values"] = ["x"]
    spec = {**BASE, "template": template}
    errors = validate_object("demo", spec)
    assert [e.field for e in errors] == [
        f"spec.template.nodeSelector[{CONTROL_PLANE}]",
        "spec.template.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
        ".nodeSelectorTerms[1].matchExpressions[0]",
        "spec.template.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
        ".preference.matchExpressions[0]",
        "spec.template.tolerations[0]",
        "spec.template.tolerations[1]",
        "spec.template.tolerations[2]",
    ]
    assert all("control-plane nodes (--allow-control-plane)" in e.message for e in errors)
    assert validate_object("demo", spec, PodPolicy(allow_control_plane=True)) == []


@pytest.mark.parametrize("name", ["a-ranks", "demo-ranks"])
def test_a_name_that_another_clusters_derived_names_take_is_refused(name: str) -> None:
    """IC `a-ranks`'s client Service `a-ranks` would be IC `a`'s headless Service."""
    [error] = validate_object(name, dict(BASE))
    assert error.field == "metadata.name" and "'-ranks'" in error.message
    assert validate_object("ranks", dict(BASE)) == validate_object("a-rank", dict(BASE)) == []


def layout_errors(source: str, **parallelism: object) -> list[tuple[str, str]]:
    spec = {"model": {"source": source}, "parallelism": parallelism}
    return [(e.field, e.message) for e in validate_object("demo", spec)]


def test_expert_parallel_is_refused_for_a_dense_model_naming_the_field() -> None:
    assert layout_errors("Qwen/Qwen3-0.6B", tensor=2, expertParallel=True) == [
        (
            "spec.parallelism.expertParallel",
            "the model has no experts (model 'Qwen/Qwen3-0.6B' is a dense qwen3 model)",
        )
    ]
    assert layout_errors("Qwen/Qwen3-0.6B", tensor=2) == []
    assert layout_errors("/models/unknown-moe", tensor=7, expertParallel=True) == []  # left to the runtime


def test_expert_parallel_needs_the_experts_to_split_over_the_tensor_ranks() -> None:
    # Qwen1.5-MoE-A2.7B: 16 heads, 16 KV heads, a shared expert of 5,632 columns all split over
    # 8 ranks, and each of the 60 experts' 1,408 columns too; its experts do not go whole to 8.
    source = "Qwen/Qwen1.5-MoE-A2.7B"
    assert layout_errors(source, tensor=8) == []
    assert layout_errors(source, tensor=8, expertParallel=True) == [
        (
            "spec.parallelism.tensor",
            "60 experts do not split over 8 ranks under expertParallel (model 'Qwen/Qwen1.5-MoE-A2.7B')",
        )
    ]
    assert layout_errors(source, tensor=4, pipeline=2, expertParallel=True) == []  # 15 experts a rank
    # Heads that do not split are named before experts.
    assert layout_errors(source, tensor=3, expertParallel=True) == [
        (
            "spec.parallelism.tensor",
            "16 attention heads do not split over 3 ranks (model 'Qwen/Qwen1.5-MoE-A2.7B')",
        )
    ]
    for source, tensor in (("mistralai/Mixtral-8x7B-v0.1", 8), ("Qwen/Qwen3-30B-A3B", 4)):
        assert layout_errors(source, tensor=tensor, expertParallel=True) == []
    # Under expertParallel one rank is every expert's; the flag alone refuses nothing.
    assert layout_errors("Qwen/Qwen3-30B-A3B", expertParallel=True) == []
