"""Hardening against the genuine API server: caps in the schema, and every refusal reported.

The reconciler runs one pass in-process under the chart's RBAC identity, with no webhook,
so whatever the API server or the rules refuse must show up as status and Events.
"""

from __future__ import annotations

import asyncio
from typing import Any

import yaml

from tessera_operator.builders import ClusterRef
from tessera_operator.kube import KubeClient
from tessera_operator.planner import Event
from tessera_operator.reconcile import Reconciler
from tests.integration.operator_harness import condition, ic, install_rbac, kjson, pods, wait_for


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

    apply(cluster, ns, "fine")
    one_pass(kubeconfig, ns, "fine")
    created = [p for p in pods(cluster, ns) if p["metadata"]["name"].startswith("fine-")]
    assert len(created) == 2 and condition(ic(cluster, ns, "fine"), "Degraded")["status"] == "False"
    for pod in created:  # the API server's ServiceAccount admission added no token volume
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert not [v for v in spec["volumes"] if "secret" in v or "projected" in v], spec["volumes"]
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
