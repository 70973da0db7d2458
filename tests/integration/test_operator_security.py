"""Hardening against the genuine API server: caps in the schema, and every refusal reported.

The reconciler runs one pass in-process under the chart's RBAC identity, with no webhook,
so whatever the API server or the rules refuse must show up as status and Events.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import yaml

from tessera_operator.builders import ClusterRef
from tessera_operator.kube import KubeClient
from tessera_operator.reconcile.events import Event
from tessera_operator.reconcile.reconciler import Reconciler
from tests.integration.operator_harness import (
    condition,
    ic,
    install_rbac,
    kjson,
    pods,
    running_operator,
    wait_for,
)


def apply(cluster: Any, ns: str, name: str, check: bool = True, **spec: Any) -> Any:
    doc = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": name},
        "spec": {"model": {"source": "smollm2-135m-instruct"}, "parallelism": {"pipeline": 2}, **spec},
    }
    return cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(doc), check=check)


def one_pass(kubeconfig: str, ns: str, name: str) -> float | None:
    async def run() -> float | None:
        client = KubeClient.from_environment(kubeconfig)
        try:
            return await Reconciler(client).reconcile(ns, name)
        finally:
            await client.close()

    return asyncio.run(run())


def post_again(kubeconfig: str, ref: ClusterRef, event: Event) -> None:
    async def run() -> None:
        client = KubeClient.from_environment(kubeconfig)
        try:
            await Reconciler(client).post_events(ref, [event])
        finally:
            await client.close()

    asyncio.run(run())


def warning_events(cluster: Any, ns: str, name: str) -> list[dict[str, Any]]:
    items = kjson(cluster, "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")[
        "items"
    ]
    return [e for e in items if e["type"] == "Warning"]


def test_the_schema_caps_replicas_also_through_the_scale_subresource(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    result = apply(cluster, ns, "huge", check=False, replicas=100_000)
    assert result.returncode != 0 and "spec.replicas" in result.stderr, result.stderr
    apply(cluster, ns, "small")
    result = cluster.kubectl("scale", "ic", "small", "-n", ns, "--replicas=100000", check=False)
    assert result.returncode != 0 and "spec.replicas" in result.stderr, result.stderr


def test_one_pass_without_a_webhook_reports_what_it_cannot_act_on(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    kubeconfig = install_rbac(cluster, ns, ns)

    apply(cluster, ns, "overflow", engine={"kvCacheMemory": "1e400"})  # passes the schema's pattern
    assert one_pass(kubeconfig, ns, "overflow") is None
    degraded = condition(ic(cluster, ns, "overflow"), "Degraded")
    assert degraded["reason"] == "InvalidSpec" and "spec.engine.kvCacheMemory" in degraded["message"]
    [event] = warning_events(cluster, ns, "overflow")
    assert event["reason"] == "InvalidSpec" and "spec.engine.kvCacheMemory" in event["message"]

    # A field path the operator does not judge: the API server's dry run of a pod (under the
    # chart's RBAC) refuses it, and the spec is held as invalid before any pod is made.
    where = {"name": "WHERE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.nowhere"}}}
    apply(cluster, ns, "refused", template={"env": [where]})
    one_pass(kubeconfig, ns, "refused")
    one_pass(kubeconfig, ns, "refused")
    degraded = condition(ic(cluster, ns, "refused"), "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec", degraded
    assert "spec.template" in degraded["message"] and "fieldRef.fieldPath" in degraded["message"]
    [event] = warning_events(cluster, ns, "refused")  # one Event, not one per pass
    assert event["reason"] == "InvalidSpec" and "fieldRef.fieldPath" in event["message"]
    # Posted again (after a restart, or a POST retried after its answer was lost): the same object,
    # counted, under the chart's RBAC.
    ref = ClusterRef("refused", ns, ic(cluster, ns, "refused")["metadata"]["uid"])
    post_again(kubeconfig, ref, Event(event["type"], event["reason"], event["message"]))
    [again] = warning_events(cluster, ns, "refused")
    assert again["metadata"]["uid"] == event["metadata"]["uid"] and again["count"] == 2
    assert not [p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("refused-")]

    apply(cluster, ns, "fine", router={"enabled": False})  # the quota below counts ranks only
    one_pass(kubeconfig, ns, "fine")
    created = [p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("fine-")]
    assert len(created) == 2 and condition(ic(cluster, ns, "fine"), "Degraded")["status"] == "False"
    for pod in created:  # the API server's ServiceAccount admission added no token volume
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        secrets = [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v]
        assert secrets == ["fine-group-secret"], spec["volumes"]  # the group's own key, no token
        assert not [v for v in spec["volumes"] if "projected" in v], spec["volumes"]
        assert all("serviceaccount" not in m["mountPath"] for m in spec["containers"][0]["volumeMounts"])
        assert spec["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True

    # An exhausted ResourceQuota: the API server answers 403, the object says so.
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "pods"},
        "spec": {"hard": {"pods": "2"}},
    }
    cluster.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(quota))
    # Pod admission finds the quota in the API server's cache. Until that cache has it, the
    # server goes by a list of the namespace's quotas that it keeps for 30 s, and that list was
    # empty when the pods above were created. kube-controller-manager counts the quota's usage
    # only after the quota reached it by the same watch.
    wait_for(
        lambda: (
            kjson(cluster, "get", "resourcequota", "pods", "-n", ns)
            .get("status", {})
            .get("used", {})
            .get("pods")
            == "2"
        ),
        "the quota's usage to be counted",
    )
    apply(cluster, ns, "over-quota")
    one_pass(kubeconfig, ns, "over-quota")
    degraded = condition(ic(cluster, ns, "over-quota"), "Degraded")
    assert degraded["reason"] == "FailedCreate" and "403" in degraded["message"], degraded
    assert "quota" in degraded["message"], degraded


# --- issue 63 ---


def test_the_group_secret_is_owned_keyed_per_group_and_each_pod_mounts_only_its_own(
    crds: Any, k8s_namespace: str
) -> None:
    cluster, ns = crds, k8s_namespace
    kubeconfig = install_rbac(cluster, ns, ns)  # the chart's Role: secrets get/create/patch suffice
    apply(
        cluster,
        ns,
        "keyed",
        replicas=2,
        networkPolicy={"enabled": True, "clientNamespaceSelector": {"team": "a"}},
    )
    one_pass(kubeconfig, ns, "keyed")
    obj = ic(cluster, ns, "keyed")
    secret = kjson(cluster, "get", "secret", "keyed-group-secret", "-n", ns)
    assert secret["type"] == "Opaque" and sorted(secret["data"]) == ["group-0", "group-1"]
    [owner] = secret["metadata"]["ownerReferences"]
    assert owner["uid"] == obj["metadata"]["uid"] and owner["controller"] is True
    assert secret["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "tessera-operator"
    created = [p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("keyed-")]
    assert len(created) == 4
    for pod in created:
        group = pod["metadata"]["labels"]["tessera.dev/group"]
        [volume] = [v for v in pod["spec"]["volumes"] if "secret" in v]
        assert volume["secret"]["items"] == [{"key": f"group-{group}", "path": "secret"}]
        assert volume["secret"]["defaultMode"] == 0o400
        [mount] = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["mountPath"] == "/etc/tessera/group-secret" and mount["readOnly"] is True
    # The values appear in no Event, no status and no pod.
    said = json.dumps([obj.get("status"), warning_events(cluster, ns, "keyed"), created])
    assert not any(value in said for value in secret["data"].values())

    # spec.networkPolicy: both policies, owned, selecting by the labels only the operator sets.
    policies = {p["metadata"]["name"]: p for p in kjson(cluster, "get", "networkpolicy", "-n", ns)["items"]}
    assert {"keyed-ranks", "keyed-clients"} <= set(policies)
    ranks, clients = policies["keyed-ranks"], policies["keyed-clients"]
    managed = {"app.kubernetes.io/managed-by": "tessera-operator", "tessera.dev/cluster": "keyed"}
    assert ranks["spec"]["podSelector"]["matchLabels"] == managed
    assert ranks["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": managed}}]}]
    assert clients["spec"]["podSelector"]["matchLabels"] == {**managed, "tessera.dev/role": "leader"}
    assert clients["spec"]["ingress"][0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert clients["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]

    # A new group gets its key; the running groups keep theirs.
    cluster.kubectl("scale", "ic", "keyed", "-n", ns, "--replicas=3")
    one_pass(kubeconfig, ns, "keyed")
    after = kjson(cluster, "get", "secret", "keyed-group-secret", "-n", ns)["data"]
    assert sorted(after) == ["group-0", "group-1", "group-2"]
    assert {k: after[k] for k in secret["data"]} == secret["data"]
    # Off again: the operator removes its policies.
    cluster.kubectl(
        "patch", "ic", "keyed", "-n", ns, "--type=merge", "-p", '{"spec":{"networkPolicy":{"enabled":false}}}'
    )
    one_pass(kubeconfig, ns, "keyed")
    left = [p["metadata"]["name"] for p in kjson(cluster, "get", "networkpolicy", "-n", ns)["items"]]
    assert not [n for n in left if n.startswith("keyed-")]


def unreadable_manifest(name: str) -> str:
    """A spec the model cannot read: spec.template.affinity past its 64 KiB cap. (A spec 1500
    levels deep is what the issue asks about, but this API server (1.20) cannot store one: a
    create of a free-form field even 30 levels deep times out after 34 s, 20 levels take 5 s, and
    nothing is stored. The reconciler's own handling of 1500 levels is in test_reconcile_unit.)"""
    doc = {
        "apiVersion": "tessera.dev/v1alpha1",
        "kind": "InferenceCluster",
        "metadata": {"name": name},
        "spec": {
            "model": {"source": "smollm2-135m-instruct"},
            "template": {"affinity": {"nodeAffinity": {"x": "y" * 70_000}}},
        },
    }
    return json.dumps(doc)


def test_a_spec_the_model_cannot_read_is_degraded_once_and_the_namespace_still_reconciles(
    crds: Any, k8s_namespace: str
) -> None:
    """No webhook: the API server stores a spec 1500 levels deep (its decoder takes 10000). The
    running operator (kopf's watch of the namespace included) must report it, once, and go on
    reconciling the other clusters of the namespace, those created after it too."""
    cluster, ns = crds, k8s_namespace
    cluster.kubectl("create", "-n", ns, "-f", "-", input=unreadable_manifest("deep"))
    with running_operator(cluster, ns) as operator:

        def deep_degraded() -> str:
            # Read with jsonpath: this test's own json.loads could not decode the whole object.
            out = cluster.kubectl(
                "get", "ic", "deep", "-n", ns, "-o",
                'jsonpath={.status.conditions[?(@.type=="Degraded")].reason}',
            ).stdout  # fmt: skip
            return str(out).strip()

        apply(cluster, ns, "after")  # created after the deep one: the watch still sees it
        wait_for(
            lambda: len([p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("after-")]) == 2,
            "the other cluster's pods",
        )
        wait_for(lambda: deep_degraded() == "InvalidSpec", "the deep cluster's Degraded condition")
        message = cluster.kubectl(
            "get", "ic", "deep", "-n", ns, "-o",
            'jsonpath={.status.conditions[?(@.type=="Degraded")].message}',
        ).stdout  # fmt: skip
        assert "spec.template.affinity" in message, message
        time.sleep(3 * operator.resync)  # several resyncs: still one Event, no retry loop
        [event] = warning_events(cluster, ns, "deep")
        assert event["reason"] == "InvalidSpec" and "spec.template.affinity" in event["message"]
        assert event.get("count", 1) == 1
        assert "Traceback" not in operator.log(), operator.log()
        assert not [p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("deep-")]
        # An edit of another cluster still reaches the operator (its kopf watch lives).
        cluster.kubectl("scale", "ic", "after", "-n", ns, "--replicas=2")
        wait_for(
            lambda: len([p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("after-")]) == 4,
            "the scaled cluster's pods",
        )
