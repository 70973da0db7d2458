"""Gang scheduling (spec.scheduling) against the genuine API server: Volcano's PodGroups and
Kueue's pod-group labels, as objects and their lifecycle (no scheduler runs: no pod is bound).

The PodGroup CRD (tests/fixtures/volcano_podgroup_crd.yaml) is registered by this module, after
its first test has seen the operator without it.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.integration.operator_harness import (
    FakeKubelet,
    apply_example,
    condition,
    ic,
    kjson,
    pod_names,
    pods,
    running_operator,
    wait_for,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "volcano_podgroup_crd.yaml"
CRD = "podgroups.scheduling.volcano.sh"
GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
THREE = {"tensor": 3, "pipeline": 1}  # 3 pods a group
VOLCANO = {"scheduler": "volcano", "volcano": {"queue": "inference"}}


def crd_installed(cluster: Any) -> bool:
    return cluster.kubectl("get", "crd", CRD, check=False).returncode == 0


def pod_groups(cluster: Any, ns: str) -> dict[str, dict[str, Any]]:
    items = kjson(cluster, "get", "podgroups.scheduling.volcano.sh", "-n", ns)["items"]
    return {pg["metadata"]["name"]: pg for pg in items if not pg["metadata"].get("deletionTimestamp")}


@contextmanager
def first_versions(cluster: Any, ns: str, kind: str) -> Iterator[dict[str, tuple[int, str]]]:
    """A watch of `kind` in `ns`: uid -> (resourceVersion of the first event, which is its
    creation, and the group it names). One etcd counts every kind's versions: they order creates."""
    seen: dict[str, tuple[int, str]] = {}
    columns = (
        "UID:.metadata.uid,RV:.metadata.resourceVersion,NAME:.metadata.name,"
        r"GROUP:.metadata.annotations.scheduling\.k8s\.io/group-name"
    )
    cmd = [
        str(Path(cluster.bin_dir) / "kubectl"), "--kubeconfig", cluster.kubeconfig, "get", kind,
        "-n", ns, "-l", "tessera.dev/cluster", "--watch", "--no-headers", "-o", f"custom-columns={columns}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=cluster.env)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            uid, rv, name, group = line.split()
            seen.setdefault(uid, (int(rv), name if kind.startswith("podgroups") else group))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield seen
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(timeout=5)


def patch_ic(cluster: Any, ns: str, spec: dict[str, Any]) -> None:
    cluster.kubectl("patch", "ic", "smollm2", "-n", ns, "--type", "merge", "-p", json.dumps({"spec": spec}))


def test_volcano_without_its_crd_is_degraded_naming_spec_scheduling(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    if crd_installed(cluster):
        pytest.skip("the PodGroup CRD is registered already (this module ran before in this session)")
    with running_operator(cluster, ns) as operator:
        apply_example(cluster, ns, "smollm2.yaml", parallelism=THREE, scheduling=VOLCANO)

        def degraded() -> dict[str, Any]:
            found = condition(ic(cluster, ns, "smollm2"), "Degraded")
            return found if found.get("status") == "True" else {}

        found = wait_for(degraded, "Degraded")
        assert found["reason"] == "SchedulerUnavailable", found
        assert found["message"].startswith("spec.scheduling.scheduler: volcano"), found
        assert "scheduling.volcano.sh/v1beta1" in found["message"]
        assert pod_names(cluster, ns) == set()  # held: no scheduler would ever take them
        # Reported, not retried in a loop of crashes: the operator stays up and healthy.
        assert operator.healthy()


def test_volcano_podgroups_precede_their_pods_and_follow_scale_and_rollout(
    crds: Any, k8s_namespace: str
) -> None:
    cluster, ns = crds, k8s_namespace
    cluster.kubectl("apply", "-f", str(FIXTURE))
    cluster.kubectl("wait", "--for", "condition=established", f"crd/{CRD}", "--timeout=60s")
    with (
        first_versions(cluster, ns, "podgroups.scheduling.volcano.sh") as groups_made,
        first_versions(cluster, ns, "pods") as pods_made,
        running_operator(cluster, ns),
        FakeKubelet(cluster, ns),
    ):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=THREE, scheduling=VOLCANO)
        wait_for(lambda: len(pod_names(cluster, ns)) == 3, "group 0")
        [(name, pg)] = pod_groups(cluster, ns).items()
        revision = pods(cluster, ns)[0]["metadata"]["labels"]["tessera.dev/revision"]
        assert name == f"smollm2-g0-{revision}"
        assert pg["spec"]["minMember"] == 3 and pg["spec"]["queue"] == "inference"
        [owner] = pg["metadata"]["ownerReferences"]
        assert (
            owner["kind"] == "InferenceCluster"
            and owner["uid"] == ic(cluster, ns, "smollm2")["metadata"]["uid"]
        )
        for pod in pods(cluster, ns):
            assert pod["spec"]["schedulerName"] == "volcano"
            assert pod["metadata"]["annotations"][GROUP_ANNOTATION] == name

        cluster.kubectl("scale", "ic", "smollm2", "-n", ns, "--replicas=2")
        wait_for(
            lambda: set(pod_groups(cluster, ns)) == {name, f"smollm2-g1-{revision}"}, "group 1's PodGroup"
        )
        wait_for(lambda: len(pod_names(cluster, ns)) == 6, "group 1")
        cluster.kubectl("scale", "ic", "smollm2", "-n", ns, "--replicas=1")
        wait_for(lambda: set(pod_groups(cluster, ns)) == {name}, "group 1's PodGroup gone with it")
        wait_for(lambda: len(pod_names(cluster, ns)) == 3, "group 1 gone")

        # A rollout to a pod per stage: the new pods (1) are a new gang, the old one goes with them.
        patch_ic(cluster, ns, {"template": {"ranksPerPod": 3}})
        wait_for(lambda: pod_names(cluster, ns) == {"smollm2-g0-s0"}, "group 0 at the new revision")
        new = pods(cluster, ns)[0]
        new_name = new["metadata"]["annotations"][GROUP_ANNOTATION]
        assert new_name == f"smollm2-g0-{new['metadata']['labels']['tessera.dev/revision']}" != name
        wait_for(lambda: set(pod_groups(cluster, ns)) == {new_name}, "only the new revision's PodGroup")
        assert pod_groups(cluster, ns)[new_name]["spec"]["minMember"] == 1

    # Every pod was created after the PodGroup it names (the first version of each in one etcd).
    # (The example's maxSurge 1 adds a surge group at the new revision during the rollout.)
    made = {group: rv for rv, group in groups_made.values()}
    assert {name, f"smollm2-g1-{revision}", new_name} <= set(made), made
    assert len(pods_made) >= 3 + 3 + 1, pods_made
    for rv, group in pods_made.values():
        assert made[group] < rv, (group, made, pods_made)


def test_kueue_pods_carry_the_pod_group_labels(crds: Any, k8s_namespace: str) -> None:
    cluster, ns = crds, k8s_namespace
    kueue = {"scheduler": "kueue", "kueue": {"queueName": "user-queue"}}
    with running_operator(cluster, ns):
        apply_example(cluster, ns, "smollm2.yaml", parallelism=THREE, scheduling=kueue)
        wait_for(lambda: len(pod_names(cluster, ns)) == 3, "group 0")
        made = pods(cluster, ns)
    revision = made[0]["metadata"]["labels"]["tessera.dev/revision"]
    for pod in made:
        labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
        assert labels["kueue.x-k8s.io/queue-name"] == "user-queue"
        assert labels["kueue.x-k8s.io/pod-group-name"] == f"smollm2-g0-{revision}"
        assert annotations["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert annotations["kueue.x-k8s.io/pod-group-serving"] == "true"
        assert pod["spec"]["schedulerName"] == "default-scheduler"  # Kueue gates them itself
