"""The local control plane is a genuine Kubernetes: schema validation, garbage collection, RBAC, helm."""

from __future__ import annotations

import http.client
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from e2e.local_cluster import KubectlError, LocalCluster

pytestmark = pytest.mark.k8s

CRD_NAME = "widgets.selftest.tessera.dev"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": CRD_NAME},
    "spec": {
        "group": "selftest.tessera.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["replicas"],
                                "properties": {"replicas": {"type": "integer", "minimum": 1}},
                            }
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, replicas: int) -> dict[str, object]:
    return {
        "apiVersion": "selftest.tessera.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"replicas": replicas},
    }


def eventually(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.2)


@pytest.fixture
def widget_crd(k8s_cluster: LocalCluster) -> Iterator[str]:
    k8s_cluster.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{CRD_NAME}", "--timeout=60s")
    yield CRD_NAME
    k8s_cluster.kubectl("delete", "crd", CRD_NAME, "--wait=false", check=False)


def test_crd_registers_and_its_schema_rejects_invalid_objects(
    k8s_cluster: LocalCluster, k8s_namespace: str, widget_crd: str
) -> None:
    ns = k8s_namespace
    k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(widget("good", 2)))
    got = json.loads(k8s_cluster.kubectl("get", "widget", "good", "-n", ns, "-o", "json").stdout)
    assert got["spec"] == {"replicas": 2}

    with pytest.raises(KubectlError) as rejected:
        k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(widget("bad", 0)))
    assert "spec.replicas" in rejected.value.stderr

    with pytest.raises(urllib.error.HTTPError) as raw:
        k8s_cluster.api("POST", f"/apis/selftest.tessera.dev/v1/namespaces/{ns}/widgets", widget("bad", 0))
    assert raw.value.code == 422
    status = json.loads(raw.value.read())
    assert [cause["field"] for cause in status["details"]["causes"]] == ["spec.replicas"]
    # Nothing invalid was stored.
    listed = json.loads(k8s_cluster.kubectl("get", "widgets", "-n", ns, "-o", "json").stdout)
    assert [item["metadata"]["name"] for item in listed["items"]] == ["good"]


def test_owned_configmap_is_garbage_collected_after_its_owner_is_deleted(
    k8s_cluster: LocalCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    owner = k8s_cluster.api(
        "POST", f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": "owner"}, "data": {"k": "v"}}
    )
    owner_ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
    child = {"metadata": {"name": "child", "ownerReferences": [owner_ref]}, "data": {}}
    k8s_cluster.api("POST", f"/api/v1/namespaces/{ns}/configmaps", child)
    unowned = {"metadata": {"name": "bystander"}, "data": {}}
    k8s_cluster.api("POST", f"/api/v1/namespaces/{ns}/configmaps", unowned)

    k8s_cluster.kubectl("delete", "configmap", "owner", "-n", ns)

    def child_gone() -> bool:
        return k8s_cluster.kubectl("get", "configmap", "child", "-n", ns, check=False).returncode != 0

    eventually(child_gone, "the garbage collector deletes the owned ConfigMap")
    assert "NotFound" in k8s_cluster.kubectl("get", "configmap", "child", "-n", ns, check=False).stderr
    k8s_cluster.kubectl("get", "configmap", "bystander", "-n", ns)


def _can_list_configmaps(cluster: LocalCluster, kubeconfig: str, ns: str) -> bool:
    return cluster.kubectl("get", "configmaps", "-n", ns, kubeconfig=kubeconfig, check=False).returncode == 0


@pytest.mark.parametrize(
    ("user", "subject_kind"),
    [("tessera-operator", "User"), ("system:serviceaccount:{ns}:operator", "ServiceAccount")],
    ids=["static-token-user", "service-account-identity-by-client-cert"],
)
def test_rbac_denies_a_non_admin_user_until_a_role_binds_it(
    k8s_cluster: LocalCluster, k8s_namespace: str, user: str, subject_kind: str
) -> None:
    ns = k8s_namespace
    user = user.format(ns=ns)
    kubeconfig = k8s_cluster.user_kubeconfig(user)

    denied = k8s_cluster.kubectl("get", "configmaps", "-n", ns, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert "Forbidden" in denied.stderr and user in denied.stderr

    subject = {"kind": "User", "name": user, "apiGroup": "rbac.authorization.k8s.io"}
    if subject_kind == "ServiceAccount":
        subject = {"kind": "ServiceAccount", "name": "operator", "namespace": ns}
    rbac = [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "configmap-reader", "namespace": ns},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "configmap-reader", "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader"},
            "subjects": [subject],
        },
    ]
    k8s_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))

    eventually(lambda: _can_list_configmaps(k8s_cluster, kubeconfig, ns), f"{user} may list configmaps")
    # Least privilege: the binding grants exactly the Role, nothing else.
    for verb_args in (["get", "secrets", "-n", ns], ["get", "configmaps", "-n", "kube-system"]):
        result = k8s_cluster.kubectl(*verb_args, kubeconfig=kubeconfig, check=False)
        assert result.returncode != 0 and "Forbidden" in result.stderr
    cannot_create = k8s_cluster.kubectl(
        "create", "configmap", "x", "-n", ns, kubeconfig=kubeconfig, check=False
    )
    assert "Forbidden" in cannot_create.stderr


SA_MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"


def test_pods_bind_to_the_fake_node_and_tests_can_play_the_kubelet(
    k8s_cluster: LocalCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    node = json.loads(k8s_cluster.kubectl("get", "node", "tessera-node-0", "-o", "json").stdout)
    ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "0"

    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"nodeName": "tessera-node-0", "containers": [{"name": "c", "image": "busybox"}]},
    }
    k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(pod))
    k8s_cluster.api(
        "PATCH",
        f"/api/v1/namespaces/{ns}/pods/p/status",
        {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        content_type="application/merge-patch+json",
    )
    phase = k8s_cluster.kubectl("get", "pod", "p", "-n", ns, "-o", "jsonpath={.status.phase}").stdout
    assert phase == "Running"
    # The ServiceAccount admission plugin added the bound token volume (BoundServiceAccountTokenVolume,
    # as from 1.21 on): a token the kubelet requests for the pod, the cluster CA, the namespace.
    got = json.loads(k8s_cluster.kubectl("get", "pod", "p", "-n", ns, "-o", "json").stdout)
    assert got["spec"]["serviceAccountName"] == "default"
    [volume] = [v for v in got["spec"]["volumes"] if v["name"].startswith("kube-api-access-")]
    sources = [sorted(source) for source in volume["projected"]["sources"]]
    assert sources == [["serviceAccountToken"], ["configMap"], ["downwardAPI"]]
    mount = got["spec"]["containers"][0]["volumeMounts"][0]
    assert mount == {"name": volume["name"], "mountPath": SA_MOUNT_PATH, "readOnly": True}


def test_etcd_answers_only_a_client_with_a_certificate_of_the_clusters_ca(k8s_cluster: LocalCluster) -> None:
    """etcd holds every Secret: a local user without the apiserver's client certificate gets nothing."""
    anonymous = ssl.create_default_context(cafile=k8s_cluster.ca_file)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"{k8s_cluster.etcd_url}/version", context=anonymous, timeout=10).read()
    plain = k8s_cluster.etcd_url.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
        urllib.request.urlopen(f"{plain}/version", timeout=10).read()
    pki = Path(k8s_cluster.ca_file).parent
    apiserver = ssl.create_default_context(cafile=k8s_cluster.ca_file)
    apiserver.load_cert_chain(pki / "apiserver-etcd-client.crt", pki / "apiserver-etcd-client.key")
    with urllib.request.urlopen(f"{k8s_cluster.etcd_url}/version", context=apiserver, timeout=10) as answer:
        assert b"etcdserver" in answer.read()


def test_client_binaries_are_the_cached_ones(k8s_cluster: LocalCluster) -> None:
    kubectl = subprocess.run(
        ["kubectl", "version", "--client", "--short"], env=k8s_cluster.env, capture_output=True, text=True
    )
    assert kubectl.returncode == 0 and "v1.20.2" in kubectl.stdout
    scheduler = subprocess.run(
        ["kube-scheduler", "--version"], env=k8s_cluster.env, capture_output=True, text=True
    )
    assert scheduler.returncode == 0 and "v1.20.2" in scheduler.stdout
    server = json.loads(k8s_cluster.kubectl("version", "-o", "json").stdout)["serverVersion"]
    assert server["gitVersion"].startswith("v1.20.2")

    helm = subprocess.run(["helm", "version", "--short"], env=k8s_cluster.env, capture_output=True, text=True)
    assert helm.returncode == 0 and helm.stdout.startswith("v")


def test_helm_installs_a_chart_into_the_cluster(
    k8s_cluster: LocalCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "hello"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: hello\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hi\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-greeting\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    helm = subprocess.run(
        ["helm", "install", "rel", str(chart), "-n", k8s_namespace, "--set", "greeting=hello", "--wait"],
        env=k8s_cluster.env,
        capture_output=True,
        text=True,
    )
    assert helm.returncode == 0, helm.stderr
    data = k8s_cluster.kubectl("get", "configmap", "rel-greeting", "-n", k8s_namespace, "-o", "json").stdout
    assert json.loads(data)["data"] == {"greeting": "hello"}
