import argparse
import copy
from typing import Any

import pytest

from tessera.engine.arg_utils import engine_config_from_args
from tessera.entrypoints.serve_args import add_serve_args
from tessera.topology import Topology
from tessera_operator import builders, naming
from tessera_operator.api import InferenceClusterSpec, TemplateSpec
from tests.operator.sim import REF, spec_of


def env_dict(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_one_pod_per_stage_and_tp_rank_with_stable_dns_names() -> None:
    spec = spec_of()
    pods = builders.build_group(REF, spec, "rev1", 1)
    names = [p["metadata"]["name"] for p in pods]
    assert names == ["demo-g1-s0-t0", "demo-g1-s0-t1", "demo-g1-s1-t0", "demo-g1-s1-t1"]
    for pod in pods:
        assert pod["spec"]["hostname"] == pod["metadata"]["name"]
        assert pod["spec"]["subdomain"] == "demo-ranks"
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "tessera.dev/v1alpha1",
                "kind": "InferenceCluster",
                "name": "demo",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    assert pods[3]["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "tessera-operator",
        "tessera.dev/cluster": "demo",
        "tessera.dev/group": "1",
        "tessera.dev/stage": "1",
        "tessera.dev/tp-rank": "1",
        "tessera.dev/role": "worker",
        "tessera.dev/revision": "rev1",
    }
    assert pods[0]["metadata"]["labels"]["tessera.dev/role"] == "leader"


def test_env_is_the_runtime_topology_contract() -> None:
    spec = spec_of(
        parallelism={"tensor": 3, "pipeline": 2, "sequenceParallel": True, "layerPartition": [16, 14]}
    )
    pod = builders.build_pod(REF, spec, "rev1", 2, 1, 2)
    env = env_dict(pod)
    topology = Topology.from_env(env)  # the runtime's own reader accepts it
    assert (topology.group, topology.pp_rank, topology.tp_rank, topology.rank) == (2, 1, 2, 5)
    assert topology.world_size == 6 and topology.sequence_parallel
    assert topology.layer_partition == [16, 14]
    assert env["TESSERA_LEADER_ADDR"] == "demo-g2-s0-t0.demo-ranks.ns.svc" == env["MASTER_ADDR"]
    assert env["PYTHONHASHSEED"] == "0"
    assert env["TESSERA_CLUSTER"] == "demo" and env["TESSERA_NAMESPACE"] == "ns"


def test_leader_serves_workers_follow_and_only_the_leader_has_a_readiness_probe() -> None:
    spec = spec_of(
        model={"source": "smollm2-135m-instruct", "servedName": "smollm2", "maxModelLen": 2048},
        engine={"kvCacheMemory": "1Gi", "enablePrefixCaching": False},
    )
    leader, worker = builders.build_pod(REF, spec, "r", 0, 0, 0), builders.build_pod(REF, spec, "r", 0, 0, 1)
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lc["command"] == ["tessera", "serve"] and wc["command"] == ["tessera", "worker"]
    assert lc["args"][0] == "smollm2-135m-instruct"
    assert lc["args"][lc["args"].index("--served-model-name") + 1] == "smollm2"
    # The leader's flags parse with the runtime's own parser into the spec's settings; workers
    # take every setting from their leader.
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = engine_config_from_args(parser.parse_args(lc["args"]), "smollm2-135m-instruct")
    assert (config.kv_cache_memory, config.max_model_len, config.enable_prefix_caching) == (
        2**30,
        2048,
        False,
    )
    assert (config.generation_config, config.override_generation_config) == ("auto", None)
    assert "--generation-config" not in lc["args"]  # a default adds no flag: no rollout on an upgrade
    assert wc["args"] == []
    assert lc["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "readinessProbe" not in wc
    assert {p["name"] for p in lc["ports"]} == {"dist", "rpc", "http"}
    assert {p["name"] for p in wc["ports"]} == {"dist", "rpc"}
    assert leader["spec"]["securityContext"]["runAsNonRoot"] is True
    assert lc["securityContext"]["allowPrivilegeEscalation"] is False


def test_template_fields_are_merged_and_gpus_added_per_rank() -> None:
    spec = spec_of(
        template={
            "image": "registry/runtime-cuda:1",
            "imagePullSecrets": ["registry-creds"],
            "gpusPerRank": 1,
            "resources": {"limits": {"memory": "64Gi"}},
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "TESSERA_RANK", "value": "7"}],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
            "affinity": {"nodeAffinity": {"x": 1}},
        }
    )
    pod = builders.build_pod(REF, spec, "r", 0, 1, 0)
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry/runtime-cuda:1"
    assert container["resources"] == {
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
        "requests": {"nvidia.com/gpu": 1},
    }
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    env = env_dict(pod)
    assert env["HF_HOME"] == "/cache" and env["TESSERA_RANK"] == "2"  # the contract cannot be overridden
    # The user's volume at /cache replaces the operator's cache emptyDir.
    assert [v["name"] for v in pod["spec"]["volumes"]] == [
        "tessera-group-secret",
        "dshm",
        "tessera-tmp",
        "cache",
    ]
    assert [m["mountPath"] for m in container["volumeMounts"]] == [
        "/etc/tessera/group-secret",
        "/dev/shm",
        "/tmp",
        "/cache",
    ]
    assert pod["spec"]["affinity"]["nodeAffinity"] == {"x": 1}
    assert spec.template.affinity == {"nodeAffinity": {"x": 1}}  # the spec itself is not mutated


@pytest.mark.parametrize("mode", ["preferred", "required", "none"])
def test_tp_ranks_of_a_stage_are_co_located(mode: str) -> None:
    spec = spec_of(placement={"mode": mode, "topologyKey": "topology.kubernetes.io/zone"})
    pod = builders.build_pod(REF, spec, "r", 3, 1, 1)
    affinity = pod["spec"].get("affinity")
    if mode == "none":
        assert affinity is None
        return
    term_selector = {"tessera.dev/cluster": "demo", "tessera.dev/group": "3", "tessera.dev/stage": "1"}
    if mode == "required":
        [term] = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    else:
        [weighted] = affinity["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        term = weighted["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == term_selector
    assert term["topologyKey"] == "topology.kubernetes.io/zone"


def test_revision_changes_with_pod_affecting_fields_only() -> None:
    base = builders.revision_of(spec_of())
    assert base == builders.revision_of(spec_of())
    assert base == builders.revision_of(spec_of(replicas=5, rollout={"maxSurge": 2}))
    assert base == builders.revision_of(spec_of(restartPolicy={"backoffBaseSeconds": 1}))
    assert base != builders.revision_of(spec_of(template={"image": "other"}))
    assert base != builders.revision_of(spec_of(engine={"maxNumSeqs": 4}))
    assert base != builders.revision_of(spec_of(parallelism={"tensor": 1, "pipeline": 2}))
    # Defaults count as unset: the API server writes the CRD's defaults into every object, and an
    # operator release that adds a defaulted field must not roll every cluster (it once did).
    explicit_defaults = {"engine": {"blockSize": 16}, "template": {"imagePullSecrets": [], "env": []}}
    assert base == builders.revision_of(spec_of(**explicit_defaults))


def test_expert_parallel_reaches_the_runtime_only_when_set() -> None:
    """TESSERA_EXPERT_PARALLEL=true in every rank of an expertParallel cluster (the runtime reads
    it back); absent otherwise, so the pods of every other cluster keep the environment they had."""
    moe = {"source": "qwen3-30b-a3b"}
    on = spec_of(model=moe, parallelism={"tensor": 4, "pipeline": 2, "expertParallel": True})
    for pod in builders.build_group(REF, on, "rev1", 0):
        env = env_dict(pod)
        assert env["TESSERA_EXPERT_PARALLEL"] == "true"
        assert Topology.from_env(env).layout.enable_expert_parallel
    off = spec_of(model=moe, parallelism={"tensor": 4, "pipeline": 2, "expertParallel": False})
    for pod in builders.build_group(REF, off, "rev1", 0):
        assert "TESSERA_EXPERT_PARALLEL" not in env_dict(pod)
    assert "TESSERA_EXPERT_PARALLEL" in builders.RESERVED_ENV  # the user's env cannot turn it on


def test_the_expert_parallel_field_rolls_no_existing_cluster() -> None:
    """Revisions from before expertParallel existed (the values its release computed): the API
    server now stores `expertParallel: false` in every object, which must hash as before."""
    before = {"": "09cfecc233", "sp": "4507cdd59c", "moe": "fce08dd761"}
    specs = {
        "": {},
        "sp": {"parallelism": {"tensor": 4, "pipeline": 2, "sequenceParallel": True}},
        "moe": {"model": {"source": "qwen3-30b-a3b"}, "parallelism": {"tensor": 4}},
    }
    for key, spec in specs.items():
        assert builders.revision_of(spec_of(**spec)) == before[key], key
        stored = copy.deepcopy(spec)
        stored.setdefault("parallelism", {"tensor": 2, "pipeline": 2})["expertParallel"] = False
        assert builders.revision_of(spec_of(**stored)) == before[key], key
    turned_on = {"model": {"source": "qwen3-30b-a3b"}, "parallelism": {"tensor": 4, "expertParallel": True}}
    assert builders.revision_of(spec_of(**turned_on)) != before["moe"]  # other pods: a rollout


ONE_RANK_A_STAGE = {"parallelism": {"tensor": 1, "pipeline": 2}}


@pytest.mark.parametrize(
    ("edited", "plain"),
    [
        ({"model": {"source": "llama-3.1-8b-instruct", "servedName": "llama-3.1-8b-instruct"}}, {}),
        ({"template": {"resources": {}}}, {}),
        ({"template": {"affinity": {}}}, {}),
        ({"engine": {"samplingDefaults": {}}}, {}),
        ({"template": {"gpuResourceName": "amd.com/gpu"}}, {}),  # no GPUs asked for
        ({**ONE_RANK_A_STAGE, "placement": {"mode": "required"}}, ONE_RANK_A_STAGE),
        ({"placement": {"mode": "none", "topologyKey": "zone"}}, {"placement": {"mode": "none"}}),
    ],
)
def test_an_edit_that_builds_the_same_pods_keeps_the_revision(
    edited: dict[str, Any], plain: dict[str, Any]
) -> None:
    """As a Deployment rolls only when its pod template changes: making a default explicit, or a
    chart writing `resources: {}`, must not reload every group's model."""
    revision = builders.revision_of(spec_of(**plain))
    assert builders.revision_of(spec_of(**edited)) == revision
    ref = builders.ClusterRef("demo", "ns", "uid")
    pods = builders.build_group(ref, spec_of(**edited), revision, 0)
    assert pods == builders.build_group(ref, spec_of(**plain), revision, 0)


def test_pods_labelled_with_the_spec_as_written_stay_current() -> None:
    """Releases before the equivalences hashed `resources: {}` apart: their pods are not rolled."""
    spec = spec_of(template={"resources": {}})
    as_written = builders._digest(
        spec.model_dump(by_alias=True, mode="json"),
        spec.model_dump(by_alias=True, mode="json", exclude_defaults=True),
    )
    assert builders.revision_of(spec) != as_written
    assert builders.revision_of(spec, running={as_written}) == as_written
    assert builders.revision_of(spec, running={"0123456789"}) == builders.revision_of(spec)


def test_a_release_that_changes_a_default_keeps_the_stored_objects_revisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The API server stored the old default in every object it admitted: those objects' pods are
    what their spec says, and a new default of the operator's must not roll them."""
    stored = spec_of(template={"image": builders.REVISION_BASELINE["template"]["image"]})
    before = builders.revision_of(stored)
    changed = copy.copy(TemplateSpec.model_fields["image"])
    changed.default = "registry/runtime-cpu:0.2.0"
    monkeypatch.setitem(TemplateSpec.model_fields, "image", changed)
    TemplateSpec.model_rebuild(force=True)
    InferenceClusterSpec.model_rebuild(force=True)
    try:
        assert TemplateSpec().image == "registry/runtime-cpu:0.2.0"  # the new release's default
        assert (
            builders.revision_of(InferenceClusterSpec.model_validate(stored.model_dump(by_alias=True)))
            == before
        )
        # An object admitted under the new release holds the new image: other pods, another revision.
        assert builders.revision_of(spec_of()) != before
    finally:
        monkeypatch.undo()
        TemplateSpec.model_rebuild(force=True)
        InferenceClusterSpec.model_rebuild(force=True)
    assert TemplateSpec().image == builders.REVISION_BASELINE["template"]["image"]


def test_every_pod_affecting_default_has_a_baseline_entry() -> None:
    """A field added without one would count in every revision: the release adding it would roll
    every cluster. Its entry is its first default, kept even when the default changes later."""
    defaults = spec_of().model_dump(by_alias=True, mode="json")

    def missing(value: object, baseline: object, path: str) -> list[str]:
        if not isinstance(value, dict):
            return []
        if not isinstance(baseline, dict):
            return [path]
        return [
            found
            for key, item in value.items()
            for found in (
                [f"{path}.{key}"] if key not in baseline else missing(item, baseline[key], f"{path}.{key}")
            )
        ]

    gaps = [
        gap
        for key in builders.pod_affecting_keys()
        for gap in missing(defaults[key], builders.REVISION_BASELINE[key], key)
    ]
    assert gaps == ["model.source"]  # required: no default


def test_services_headless_for_rendezvous_and_client_for_ready_leaders() -> None:
    headless, client = builders.build_headless_service(REF), builders.build_client_service(REF)
    assert headless["metadata"]["name"] == naming.headless_service_name("demo")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    managed = {"app.kubernetes.io/managed-by": "tessera-operator"}
    assert headless["spec"]["selector"] == {"tessera.dev/cluster": "demo", **managed}
    assert client["spec"]["selector"] == {
        "tessera.dev/cluster": "demo",
        "tessera.dev/role": "leader",
        **managed,
    }
    assert "publishNotReadyAddresses" not in client["spec"]
    assert builders.endpoint_of(REF) == "http://demo.ns.svc:8000/v1"


@pytest.mark.parametrize(
    ("text", "value"),
    [("2Gi", 2 * 2**30), ("512Mi", 512 * 2**20), ("1e9", 10**9), ("1500", 1500), ("2G", 2 * 10**9)],
)
def test_quantities(text: str, value: int) -> None:
    assert builders.quantity_to_bytes(text) == value


def test_defaults_match_the_minimal_design_object() -> None:
    spec = InferenceClusterSpec.model_validate(
        {
            "model": {"source": "smollm2-135m-instruct", "servedName": "smollm2"},
            "parallelism": {"tensor": 3, "pipeline": 2, "sequenceParallel": True},
            "replicas": 1,
        }
    )
    assert len(builders.build_group(REF, spec, "r", 0)) == 6
    assert spec.rollout.max_unavailable == 1 and spec.autoscaling is None


def test_rank_pods_hold_no_token_and_write_only_to_their_empty_dirs() -> None:
    pod = builders.build_pod(REF, spec_of(), "r", 0, 0, 0)
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in pod["spec"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert mounts == {"/dev/shm": "dshm", "/cache": "tessera-cache", "/tmp": "tessera-tmp"}
    assert all("emptyDir" in volumes[name] for name in mounts.values())
    env = env_dict(pod)
    assert (env["TESSERA_CACHE"], env["TMPDIR"], env["HOME"]) == ("/cache", "/tmp", "/tmp")


def test_user_variables_come_after_the_topology_so_they_may_refer_to_it() -> None:
    spec = spec_of(template={"env": [{"name": "SHARD_DIR", "value": "/cache/$(TESSERA_RANK)"}]})
    names = [e["name"] for e in builders.build_pod(REF, spec, "r", 0, 1, 0)["spec"]["containers"][0]["env"]]
    assert names.index("TESSERA_RANK") < names.index("SHARD_DIR")


def test_the_user_may_point_the_cache_at_a_volume_of_their_own() -> None:
    spec = spec_of(
        template={
            "env": [{"name": "TESSERA_CACHE", "value": "/models/cache"}],
            "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "m"}}],
            "volumeMounts": [{"name": "models", "mountPath": "/models"}],
        }
    )
    pod = builders.build_pod(REF, spec, "r", 0, 0, 0)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.count("TESSERA_CACHE") == 1 and env_dict(pod)["TESSERA_CACHE"] == "/models/cache"


def test_the_disruption_budget_lets_one_rank_go_at_a_time_and_only_with_two_groups() -> None:
    def budget(replicas: int, version: str = "policy/v1", surge: int = 0) -> dict[str, Any] | None:
        spec = InferenceClusterSpec.model_validate(
            {"model": {"source": "m"}, "parallelism": {"tensor": 2, "pipeline": 3}, "replicas": replicas}
        )
        return builders.build_disruption_budget(REF, spec, version, surge)

    assert budget(0) is None and budget(1) is None  # a drain must always be able to proceed
    two = budget(2)
    assert two is not None and two["spec"]["minAvailable"] == 11
    assert two["spec"]["selector"] == {
        "matchLabels": {"tessera.dev/cluster": "demo", "app.kubernetes.io/managed-by": "tessera-operator"}
    }
    assert two["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert two["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    old = budget(2, "policy/v1beta1")
    assert old is not None and "unhealthyPodEvictionPolicy" not in old["spec"]
    # A rollout's surge group is selected and healthy while it loads: it must not make room for
    # a second eviction among the groups that serve.
    surging = budget(2, surge=1)
    assert surging is not None and surging["spec"]["minAvailable"] == 17


def test_a_cluster_may_opt_out_of_the_disruption_budget_and_drift_ignores_dropped_fields() -> None:
    from tessera_operator.reconcile.owned_plans import budget_drifted

    three = {"model": {"source": "m"}, "replicas": 3}
    opted_out = InferenceClusterSpec.model_validate({**three, "disruptionBudget": {"enabled": False}})
    assert builders.build_disruption_budget(REF, opted_out, "policy/v1") is None
    desired = builders.build_disruption_budget(REF, InferenceClusterSpec.model_validate(three), "policy/v1")
    assert desired is not None
    # A 1.21-1.26 API server drops unhealthyPodEvictionPolicy: no patch every pass for that.
    kept = {k: v for k, v in desired["spec"].items() if k != "unhealthyPodEvictionPolicy"}
    assert not budget_drifted(kept, desired["spec"])
    assert budget_drifted({**kept, "minAvailable": 1}, desired["spec"])
    assert budget_drifted(
        {**desired["spec"], "unhealthyPodEvictionPolicy": "IfHealthyBudget"}, desired["spec"]
    )


@pytest.mark.parametrize(("gpus", "device"), [(0, "auto"), (1, "cuda")])
def test_a_rank_given_gpus_runs_on_cuda_or_fails(gpus: int, device: str) -> None:
    spec = spec_of(template={"gpusPerRank": gpus})
    args = builders.build_pod(REF, spec, "r", 0, 0, 0)["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert engine_config_from_args(parser.parse_args(args), "smollm2-135m-instruct").device == device
    assert ("--device" in args) == (gpus > 0)  # a CPU cluster's pods keep their command


def test_sampling_defaults_reach_the_leaders_flags() -> None:
    spec = spec_of(
        engine={"generationConfig": "vllm", "samplingDefaults": {"temperature": 0.7, "maxTokens": 512}}
    )
    args = builders.build_pod(REF, spec, "r", 0, 0, 0)["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    config = engine_config_from_args(parser.parse_args(args), "smollm2-135m-instruct")
    assert config.generation_config == "vllm"
    assert config.override_generation_config == {"temperature": 0.7, "max_tokens": 512}


# --- issue 63: the group secret, NetworkPolicies, operator-only selectors, maxWaitingRequests ---


def test_every_rank_mounts_only_its_own_groups_key_read_only_as_the_runtimes_file() -> None:
    from tessera.topology import DEFAULT_GROUP_SECRET_FILE, GROUP_SECRET_FILE_ENV, GROUP_SECRET_MOUNT_DIR

    spec = spec_of(replicas=2)
    for group in (0, 1):
        for pod in builders.build_group(REF, spec, "r", group):
            volumes = [v for v in pod["spec"]["volumes"] if "secret" in v]
            assert volumes == [
                {
                    "name": "tessera-group-secret",
                    "secret": {
                        "secretName": "demo-group-secret",
                        "items": [{"key": f"group-{group}", "path": "secret"}],
                        "defaultMode": 0o400,
                    },
                }
            ]
            [mount] = [
                m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "tessera-group-secret"
            ]
            assert mount == {
                "name": "tessera-group-secret",
                "mountPath": GROUP_SECRET_MOUNT_DIR,
                "readOnly": True,
            }
            assert env_dict(pod)[GROUP_SECRET_FILE_ENV] == DEFAULT_GROUP_SECRET_FILE
            # 0400 is readable by the rank: the kubelet gives the file to the pod's fsGroup.
            context = pod["spec"]["securityContext"]
            assert context["fsGroup"] == context["runAsUser"] == builders.RUNTIME_UID


def test_the_spec_cannot_replace_the_group_secret_volume_its_mount_or_its_variable() -> None:
    from tessera.topology import DEFAULT_GROUP_SECRET_FILE, GROUP_SECRET_FILE_ENV

    assert naming.GROUP_SECRET_VOLUME in naming.OPERATOR_VOLUMES  # the pod policy refuses the name
    template = TemplateSpec.model_validate(
        {
            "volumes": [{"name": "tessera-group-secret", "emptyDir": {}}, {"name": "x", "emptyDir": {}}],
            "volumeMounts": [{"name": "x", "mountPath": "/etc/tessera/group-secret"}],
            "env": [{"name": GROUP_SECRET_FILE_ENV, "value": "/tmp/mine"}],
        }
    )
    spec = spec_of().model_copy(update={"template": template})
    pod = builders.build_pod(REF, spec, "r", 0, 0, 0)
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "tessera-group-secret"]
    assert "secret" in volume
    mounts = [
        m
        for m in pod["spec"]["containers"][0]["volumeMounts"]
        if m["mountPath"] == "/etc/tessera/group-secret"
    ]
    assert mounts == [
        {"name": "tessera-group-secret", "mountPath": "/etc/tessera/group-secret", "readOnly": True}
    ]
    env = pod["spec"]["containers"][0]["env"]
    assert [e["value"] for e in env if e["name"] == GROUP_SECRET_FILE_ENV] == [DEFAULT_GROUP_SECRET_FILE]


def test_group_secret_keys_are_added_for_new_groups_and_never_replaced() -> None:
    import base64

    data = builders.missing_group_keys({}, [0, 1])
    assert sorted(data) == ["group-0", "group-1"]
    assert all(len(base64.b64decode(v)) == 32 for v in data.values())
    assert data["group-0"] != data["group-1"]
    assert builders.missing_group_keys(data, [0, 1]) == {}
    more = builders.missing_group_keys(data, [1, 2])
    assert list(more) == ["group-2"]
    secret = builders.build_group_secret(REF, {**data, **more})
    assert secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == "demo-group-secret"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    assert secret["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "tessera-operator",
        "tessera.dev/cluster": "demo",
    }


def test_services_select_rank_pods_by_labels_only_the_operator_sets() -> None:
    managed = {"app.kubernetes.io/managed-by": "tessera-operator"}
    headless = builders.build_headless_service(REF)["spec"]["selector"]
    client = builders.build_client_service(REF)["spec"]["selector"]
    assert headless == {"tessera.dev/cluster": "demo", **managed}
    assert client == {"tessera.dev/cluster": "demo", "tessera.dev/role": "leader", **managed}
    pod_labels = builders.build_pod(REF, spec_of(), "r", 0, 0, 0)["metadata"]["labels"]
    assert headless.items() <= pod_labels.items() and client.items() <= pod_labels.items()


def test_network_policies_only_when_enabled_and_select_by_operator_only_labels() -> None:
    assert builders.build_network_policies(REF, spec_of()) == []
    spec = spec_of(
        networkPolicy={"enabled": True, "clientNamespaceSelector": {"team": "a"}}, router={"enabled": False}
    )
    ranks, clients = builders.build_network_policies(REF, spec)
    managed = {"app.kubernetes.io/managed-by": "tessera-operator"}
    assert ranks["metadata"]["name"] == "demo-ranks" and clients["metadata"]["name"] == "demo-clients"
    for policy in (ranks, clients):
        assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == REF.uid
    selector = {"matchLabels": {"tessera.dev/cluster": "demo", **managed}}
    assert ranks["spec"]["podSelector"] == selector
    assert ranks["spec"]["ingress"] == [{"from": [{"podSelector": selector}]}]  # every port
    assert clients["spec"]["podSelector"] == {
        "matchLabels": {"tessera.dev/cluster": "demo", "tessera.dev/role": "leader", **managed}
    }
    [rule] = clients["spec"]["ingress"]
    assert rule["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"team": "a"}}},
        {"namespaceSelector": {"matchLabels": {"tessera.dev/operator": "true"}}},
    ]
    both = spec_of(
        networkPolicy={
            "enabled": True,
            "clientNamespaceSelector": {"t": "a"},
            "clientPodSelector": {"app": "c"},
        }
    )
    assert builders.build_network_policies(REF, both)[1]["spec"]["ingress"][0]["from"][0] == {
        "namespaceSelector": {"matchLabels": {"t": "a"}},
        "podSelector": {"matchLabels": {"app": "c"}},
    }
    own = spec_of(networkPolicy={"enabled": True})
    assert builders.build_network_policies(REF, own)[1]["spec"]["ingress"][0]["from"][0] == {
        "podSelector": {}
    }


def test_max_waiting_requests_reaches_the_leader_only_when_set() -> None:
    leader_args = builders.build_pod(REF, spec_of(), "r", 0, 0, 0)["spec"]["containers"][0]["args"]
    assert builders.MAX_WAITING_FLAG not in leader_args  # unset: existing pods do not roll
    spec = spec_of(engine={"maxWaitingRequests": 7})
    assert builders.revision_of(spec) != builders.revision_of(spec_of())
    args = builders.build_pod(REF, spec, "r", 0, 0, 0)["spec"]["containers"][0]["args"]
    assert args[args.index(builders.MAX_WAITING_FLAG) + 1] == "7"
    assert builders.build_pod(REF, spec, "r", 0, 1, 0)["spec"]["containers"][0]["args"] == []
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(args).max_waiting_requests == 7


def test_the_pre_stop_hook_drains_the_leader_and_workers_outlive_it() -> None:
    leader, worker = builders.build_group(REF, spec_of(), "r", 0)[:2]
    hook = leader["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == [
        "tessera",
        "drain",
        "--url",
        "http://127.0.0.1:8000",
        "--min-seconds",
        "5",
        "--timeout",
        "20",
    ]
    assert leader["spec"]["terminationGracePeriodSeconds"] == 30  # as before rollout.drainSeconds
    worker_hook = worker["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert worker_hook[3] == "http://demo-g0-s0-t0.demo-ranks.ns.svc:8000"  # waits for its leader's drain
    assert worker_hook[-2:] == ["--linger", str(builders.WORKER_LINGER_SECONDS)]
    parser = argparse.ArgumentParser()
    from tessera.entrypoints.drain import register_cli

    register_cli(parser.add_subparsers(dest="command"))
    args = parser.parse_args(worker_hook[1:])  # the runtime's own flags accept the hook
    assert (args.min_seconds, args.timeout, args.linger) == (5, 20, builders.WORKER_LINGER_SECONDS)
    longer = builders.build_group(REF, spec_of(rollout={"drainSeconds": 120}), "r", 0)[0]
    assert longer["spec"]["terminationGracePeriodSeconds"] == 130
    assert longer["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1] == "120"
    # Not pod-affecting: a drain setting applies to groups made after it, and rolls none.
    assert builders.revision_of(spec_of(rollout={"drainSeconds": 120})) == builders.revision_of(spec_of())


def test_the_metrics_prefix_reaches_the_leader_only_when_not_the_default() -> None:
    leader_args = builders.build_pod(REF, spec_of(), "r", 0, 0, 0)["spec"]["containers"][0]["args"]
    assert builders.METRICS_PREFIX_FLAG not in leader_args  # existing pods do not roll
    assert builders.revision_of(spec_of(engine={"metricsPrefix": "tessera"})) == builders.revision_of(
        spec_of()
    )
    both = builders.build_pod(REF, spec_of(engine={"metricsPrefix": "both"}), "r", 0, 0, 0)
    args = both["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    assert parser.parse_args(args).metrics_prefix == "both"  # the runtime's own flag
