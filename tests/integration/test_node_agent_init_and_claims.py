"""The node agent's init containers and claim volumes, as a kubelet runs them (spec.model.cache
needs both), through kubectl against the complete local cluster: init containers run in order to
completion before the main one; a failing one fails a restartPolicy Never pod with its log's tail
as termination message (FallbackToLogsOnError); a claim of the local `local-path` class binds and
mounts (read-only where asked), one of a class that does not exist stays Pending."""

from __future__ import annotations

from typing import Any

import pytest

from e2e.local_cluster import LocalCluster
from e2e.local_provisioner import STORAGE_CLASS
from tests.integration.test_node_agent import apply, eventually, get_pod, phase_is

pytestmark = pytest.mark.k8s


def claim(name: str, storage_class: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "1Gi"}},
            "storageClassName": storage_class,
        },
    }


def container(name: str, script: str, read_only: bool = False, **extra: Any) -> dict[str, Any]:
    mount = {"name": "data", "mountPath": "/data", "readOnly": read_only}
    return {"name": name, "image": "tessera-runtime:local", "command": ["sh", "-c", script],
            "volumeMounts": [mount], **extra}  # fmt: skip


def claim_pod(name: str, claim_name: str, init: list[dict[str, Any]], main: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": init,
            "containers": [main],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": claim_name}}],
        },
    }


def test_init_containers_run_in_order_on_a_bound_claim_and_a_failing_one_fails_the_pod(
    local_cluster_full: LocalCluster, full_namespace: str
) -> None:
    cluster, ns = local_cluster_full, full_namespace
    fill = container("fill", "echo one > /data/order")
    second = container("second", "cat /data/order && echo two >> /data/order", read_only=False)
    # The main container mounts the claim read-only: its write fails, its read sees both steps.
    main = container(
        "main", "cat /data/order; touch /data/x 2>/dev/null && echo WROTE; exit 0", read_only=True
    )
    failing = container(
        "fill", "echo converting; echo 'fill failed: no such model' >&2; exit 4",
        terminationMessagePolicy="FallbackToLogsOnError",
    )  # fmt: skip
    apply(
        cluster,
        ns,
        claim("shared", STORAGE_CLASS),
        claim("nowhere", "no-such-class"),
        claim_pod("ordered", "shared", [fill, second], main),
        claim_pod("broken", "shared", [failing], container("main", "exit 0")),
        claim_pod("unbound", "nowhere", [], container("main", "exit 0")),
    )
    done = eventually(lambda: phase_is(cluster, ns, "ordered", "Succeeded", "Failed"), "pod 'ordered' ends")
    assert done["status"]["phase"] == "Succeeded", done["status"]
    inits = done["status"]["initContainerStatuses"]
    assert [c["name"] for c in inits] == ["fill", "second"]
    assert all(c["state"]["terminated"]["exitCode"] == 0 for c in inits)
    log = cluster.container_log(ns, "ordered", "main")
    assert log.split() == ["one", "two"], log  # both init steps, in order; no write through read-only

    broken = eventually(lambda: phase_is(cluster, ns, "broken", "Failed", "Succeeded"), "pod 'broken' ends")
    assert broken["status"]["phase"] == "Failed"
    (init,) = broken["status"]["initContainerStatuses"]
    terminated = init["state"]["terminated"]
    assert (
        terminated["exitCode"] == 4 and terminated["message"].splitlines()[-1] == "fill failed: no such model"
    )
    assert broken["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"
    assert cluster.container_log(ns, "broken", "main") == ""  # never started

    # An unknown class: no volume, the claim Pending, its pod unscheduled (not crash looping).
    pvc = cluster.kubectl("get", "pvc", "nowhere", "-n", ns, "-o", "jsonpath={.status.phase}").stdout
    assert pvc == "Pending"
    unbound = get_pod(cluster, ns, "unbound")
    assert unbound["status"].get("phase") == "Pending" and not unbound["spec"].get("nodeName")
