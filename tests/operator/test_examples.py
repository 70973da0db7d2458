from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera.topology import DEFAULT_API_PORT
from tessera_operator import builders, naming
from tessera_operator.admission.validation import validate_object
from tessera_operator.api import InferenceClusterSpec

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
DOCS = [(p, d) for p in sorted(EXAMPLES_DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
CLUSTERS = [(p, d) for p, d in DOCS if d["kind"] == "InferenceCluster"]


@pytest.mark.parametrize(("path", "doc"), CLUSTERS, ids=[p.name for p, _ in CLUSTERS])
def test_examples_pass_the_cross_field_rules(path: Path, doc: dict[str, Any]) -> None:
    assert validate_object(doc["metadata"]["name"], doc["spec"]) == []


def test_what_kubectl_apply_f_examples_applies_is_inference_clusters_and_a_network_policy() -> None:
    # Argo CD's health check is a patch of its argocd-cm, in a folder of its own: applied as a
    # ConfigMap it would replace Argo CD's whole configuration.
    assert {d["kind"] for _, d in DOCS} == {"InferenceCluster", "NetworkPolicy"}
    patch = yaml.safe_load((EXAMPLES_DIR / "argocd" / "health-patch.yaml").read_text())
    assert set(patch) == {"data"}


def test_gpu_example_places_one_gpu_per_rank_with_tp_on_one_node() -> None:
    doc = yaml.safe_load((EXAMPLES_DIR / "llama-70b-gpu.yaml").read_text())
    spec = InferenceClusterSpec.model_validate(doc["spec"])
    ref = builders.ClusterRef("llama-70b", "ns", "u")
    pods = builders.build_group(ref, spec, "r", 0)
    assert len(pods) == 16
    assert all(p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1 for p in pods)
    assert all(
        "requiredDuringSchedulingIgnoredDuringExecution" in p["spec"]["affinity"]["podAffinity"] for p in pods
    )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_the_network_policy_selects_the_pods_the_operator_builds() -> None:
    policies = {d["metadata"]["name"]: d["spec"] for p, d in DOCS if p.name == "networkpolicy.yaml"}
    ranks, clients = policies["smollm2-ranks"], policies["smollm2-clients"]
    spec = InferenceClusterSpec.model_validate(
        yaml.safe_load((EXAMPLES_DIR / "smollm2.yaml").read_text())["spec"]
    )
    pods = builders.build_group(builders.ClusterRef("smollm2", "ns", "u"), spec, "r", 0)
    labels = [p["metadata"]["labels"] for p in pods]
    assert all(selects(ranks["podSelector"], lab) for lab in labels)
    assert all(selects(ranks["ingress"][0]["from"][0]["podSelector"], lab) for lab in labels)
    assert "ports" not in ranks["ingress"][0]  # gloo/NCCL data connections use ephemeral ports
    leaders = [lab for lab in labels if selects(clients["podSelector"], lab)]
    assert len(leaders) == 1 and leaders[0]["tessera.dev/role"] == "leader"
    assert clients["ingress"][0]["ports"] == [{"port": DEFAULT_API_PORT, "protocol": "TCP"}]
    # The router's pods may call the leaders, as in the operator's own policy.
    router = {"podSelector": {"matchLabels": naming.router_selector("smollm2")}}
    assert router in clients["ingress"][0]["from"]


AUTOSCALING = {
    p.name: yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES_DIR / "autoscaling").glob("*.yaml"))
}


@pytest.mark.parametrize("name", sorted(AUTOSCALING))
def test_the_autoscaler_examples_target_the_scale_subresource_of_the_demo(name: str) -> None:
    from tessera_operator import api, crdgen

    crd = crdgen.build_crd()
    [version] = crd["spec"]["versions"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    target = AUTOSCALING[name]["spec"]["scaleTargetRef"]
    assert target == {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "smollm2"}


def test_the_keda_example_scales_from_zero_on_the_queue_and_the_routers_held_requests() -> None:
    from tessera.router.metrics import PREFIX as ROUTER_PREFIX

    scaled = AUTOSCALING["keda-scaledobject.yaml"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1" and scaled["kind"] == "ScaledObject"
    assert scaled["spec"]["minReplicaCount"] == 0
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
    query = trigger["metadata"]["query"]
    assert "vllm:num_requests_waiting" in query and f"{ROUTER_PREFIX}held_requests" in query
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # KEDA takes strings only
