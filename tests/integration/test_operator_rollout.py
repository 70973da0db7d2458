"""Rolling updates across replica groups on the genuine API server (a FakeKubelet readies pods)."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.integration.operator_harness import (
    FakeKubelet,
    apply_example,
    condition,
    ic,
    pods,
    running_operator,
    wait_for,
)

SMALL = {"tensor": 3, "pipeline": 2}  # 6 pods a group, as the example


def snapshot(cluster: Any, ns: str) -> dict[int, tuple[set[str], bool]]:
    """group -> (revisions of its pods, leader Ready)."""
    groups: dict[int, tuple[set[str], bool]] = {}
    for pod in pods(cluster, ns):
        labels = pod["metadata"]["labels"]
        index = int(labels["tessera.dev/group"])
        revisions, ready = groups.get(index, (set(), False))
        revisions.add(labels["tessera.dev/revision"])
        if labels["tessera.dev/role"] == "leader":
            conds = pod.get("status", {}).get("conditions") or []
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conds)
        groups[index] = (revisions, ready)
    return groups


def roll(cluster: Any, ns: str, replicas: int, timeout: float = 90) -> list[dict[int, tuple[set[str], bool]]]:
    """Change a pod-affecting field, then record snapshots until the rollout completes."""
    old = ic(cluster, ns, "smollm2")["status"]["updateRevision"]
    cluster.kubectl(
        "patch", "ic", "smollm2", "-n", ns, "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":7}}}'
    )
    new = wait_for(
        lambda: (r := ic(cluster, ns, "smollm2")["status"]["updateRevision"]) != old and r, "new revision"
    )
    trace = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trace.append(snapshot(cluster, ns))
        obj = ic(cluster, ns, "smollm2")
        done = condition(obj, "Progressing").get("reason") == "Complete"
        if done and set(trace[-1]) == set(range(replicas)) and all(r == {new} for r, _ in trace[-1].values()):
            return trace
        time.sleep(0.25)
    raise TimeoutError(f"rollout did not complete; last {trace[-1:]}")


def test_rolling_update_replaces_groups_one_at_a_time(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    rollout = {"maxUnavailable": 1, "maxSurge": 0}
    with running_operator(cluster, ns), FakeKubelet(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=2, rollout=rollout)
        wait_for(lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 2, "2 ready")
        trace = roll(cluster, ns, replicas=2)
        new = ic(cluster, ns, "smollm2")["status"]["updateRevision"]
        # never more than maxUnavailable=1 group down, never more than replicas groups
        assert all(sum(ready for _, ready in snap.values()) >= 1 for snap in trace)
        assert all(len(snap) <= 2 for snap in trace)
        # group by group: at some moment one group ran the new revision while the other still ran the old
        mixed = [
            s
            for s in trace
            if any(r == {new} for r, _ in s.values()) and any(new not in r for r, _ in s.values())
        ]
        assert mixed, trace
        status = ic(cluster, ns, "smollm2")["status"]
        assert status["updatedReplicas"] == 2 and status["currentRevision"] == new

        # An edit only the API server's pod validation refuses: held before any group goes down.
        uids = {p["metadata"]["uid"] for p in pods(cluster, ns)}
        env = [{"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.nope"}}}]
        patch = json.dumps({"spec": {"template": {"env": env}}})
        cluster.kubectl("patch", "ic", "smollm2", "-n", ns, "--type=merge", "-p", patch)
        degraded = wait_for(
            lambda: (
                (c := condition(ic(cluster, ns, "smollm2"), "Degraded")).get("reason") == "InvalidSpec" and c
            ),
            "the refused pods reported",
        )
        assert "spec.template" in degraded["message"] and "fieldRef.fieldPath" in degraded["message"]
        time.sleep(2)  # passes that would have started a rollout
        assert {p["metadata"]["uid"] for p in pods(cluster, ns)} == uids
        assert ic(cluster, ns, "smollm2")["status"]["readyReplicas"] == 2


def test_one_replica_with_max_surge_one_keeps_serving_and_finishes(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    rollout = {"maxUnavailable": 0, "maxSurge": 1}
    with running_operator(cluster, ns), FakeKubelet(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL, replicas=1, rollout=rollout)
        wait_for(lambda: ic(cluster, ns, "smollm2").get("status", {}).get("readyReplicas") == 1, "ready")
        trace = roll(cluster, ns, replicas=1)
        assert any(1 in snap for snap in trace), "a surge group carried the load"
        assert all(sum(ready for _, ready in snap.values()) >= 1 for snap in trace[1:])
        status = ic(cluster, ns, "smollm2")["status"]
        assert [g["index"] for g in status["groups"]] == [0] and status["updatedReplicas"] == 1
