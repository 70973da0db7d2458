"""The Helm chart renders least-privilege RBAC for each mode (helm from the k8s binary cache)."""

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.local_cluster import default_bin_dir

CHART = Path(__file__).resolve().parents[2] / "charts" / "tessera"
HELM = default_bin_dir() / "helm"
pytestmark = pytest.mark.skipif(not HELM.exists(), reason="helm not installed (make k8s)")


def render(*sets: str) -> list[dict[str, Any]]:
    args = [str(HELM), "template", "rel", str(CHART), "-n", "ops", "--include-crds"]
    for value in sets:
        args += ["--set", value]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def kinds(docs: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return sorted((d["kind"], d["metadata"].get("namespace")) for d in docs)


def test_namespaced_mode_grants_pods_only_through_roles() -> None:
    docs = render("watch.namespaces={a,b}")
    assert ("Role", "a") in kinds(docs) and ("Role", "b") in kinds(docs)
    cluster_rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert {res for r in cluster_rules for res in r["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
    }
    assert all(set(r["verbs"]) <= {"get", "list", "watch"} for r in cluster_rules)
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=a" in container["args"] and "--namespace=b" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert any(d["kind"] == "CustomResourceDefinition" for d in docs)


def test_cluster_wide_mode_and_managed_webhook() -> None:
    docs = render("watch.clusterWide=true", "webhook.enabled=true")
    assert not [d for d in docs if d["kind"] == "Role"]
    rules = [r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]]
    assert any("pods" in r["resources"] and "create" in r["verbs"] for r in rules)
    assert any("validatingwebhookconfigurations" in r["resources"] for r in rules)
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    assert "--all-namespaces" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
