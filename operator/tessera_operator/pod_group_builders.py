"""Pure functions: an InferenceCluster spec -> the Volcano PodGroup of a replica group
(spec.scheduling.scheduler volcano; docs/scheduling.md).

One PodGroup per (group, revision), named as its pods' `scheduling.k8s.io/group-name` annotation
says (`naming.pod_group_name`): minMember is the group's pod count, so Volcano binds all of its
pods or none, and minResources what they request together, so Volcano's enqueue step admits a
group only when the whole of it fits. Owned by the InferenceCluster (deleting it deletes them).
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import ROUND_CEILING
from typing import Any

from tessera_operator import naming
from tessera_operator.api import InferenceClusterSpec, VolcanoSpec
from tessera_operator.builders import ClusterRef, owner_reference, resources_for
from tessera_operator.quantity import parse_quantity
from tessera_operator.router_builders import SPEC_HASH_ANNOTATION, spec_hash

PODGROUP_GROUP, PODGROUP_VERSION = "scheduling.volcano.sh", "v1beta1"
PODGROUP_API_VERSION = f"{PODGROUP_GROUP}/{PODGROUP_VERSION}"


def wants_pod_groups(spec: InferenceClusterSpec) -> bool:
    return spec.scheduling.scheduler == "volcano"


def group_requests(resources: dict[str, Any]) -> dict[str, Any]:
    """One pod's requests as the scheduler counts them: a limit without a request requests it."""
    requests = dict(resources.get("limits") or {})
    requests.update(resources.get("requests") or {})
    return requests


def scaled_quantity(value: str | int | float, times: int) -> str:
    """`value` x `times` as a quantity: whole units where exact, else millis rounded up (the finest
    unit Kubernetes keeps for CPU)."""
    total = parse_quantity(value) * times
    if total == total.to_integral_value():
        return str(int(total))
    return f"{int((total * 1000).to_integral_value(rounding=ROUND_CEILING))}m"


def min_resources(spec: InferenceClusterSpec) -> dict[str, str]:
    """What the group's pods request together (they are alike in resources)."""
    per_pod = group_requests(resources_for(spec))
    return {name: scaled_quantity(value, spec.pods_per_group) for name, value in sorted(per_pod.items())}


def pod_group_labels(ref: ClusterRef, group: int, revision: str) -> dict[str, str]:
    return {
        **naming.MANAGED_BY,
        naming.CLUSTER_LABEL: ref.name,
        naming.GROUP_LABEL: str(group),
        naming.REVISION_LABEL: revision,
    }


def build_pod_group(
    ref: ClusterRef, spec: InferenceClusterSpec, revision: str, group: int
) -> dict[str, Any] | None:
    """The PodGroup of `group`'s pods at `revision`, or None when spec.scheduling is not Volcano."""
    if not wants_pod_groups(spec):
        return None
    volcano = spec.scheduling.volcano or VolcanoSpec()
    body: dict[str, Any] = {"minMember": spec.pods_per_group}
    if resources := min_resources(spec):
        body["minResources"] = resources
    if volcano.queue is not None:
        body["queue"] = volcano.queue
    if priority := volcano.priority_class_name or spec.template.priority_class_name:
        body["priorityClassName"] = priority
    pod_group: dict[str, Any] = {
        "apiVersion": PODGROUP_API_VERSION,
        "kind": "PodGroup",
        "metadata": {
            "name": naming.pod_group_name(ref.name, group, revision),
            "namespace": ref.namespace,
            "labels": pod_group_labels(ref, group, revision),
            "ownerReferences": [owner_reference(ref)],
        },
        "spec": body,
    }
    pod_group["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(pod_group)}
    return pod_group


def desired_pod_groups(
    ref: ClusterRef,
    spec: InferenceClusterSpec,
    revision: str,
    live: Iterable[tuple[int, str]],
    create_groups: Iterable[int],
) -> dict[str, dict[str, Any]]:
    """The PodGroups to make or keep as ours say, by name: one for each group whose pods are made
    now (always at `revision`) or run at it. `live`: (group, revision) of the pods that stay.
    A group still at an older revision keeps the PodGroup it has (its pods' size may differ)."""
    groups = set(create_groups) | {group for group, rev in live if rev == revision}
    bodies = (build_pod_group(ref, spec, revision, group) for group in sorted(groups))
    return {body["metadata"]["name"]: body for body in bodies if body is not None}


def stale_pod_groups(
    existing: Iterable[dict[str, Any]], desired: Iterable[str], live_names: Iterable[str]
) -> list[str]:
    """The cluster's PodGroups to delete: neither wanted nor named by a pod that stays (`live_names`:
    the group-name annotations of the pods neither terminating nor deleted by this pass), so a
    PodGroup goes in the pass that deletes its group's last pods (scale-in, a rollout)."""
    keep = set(desired) | set(live_names)
    return sorted(name for pg in existing if (name := pg["metadata"]["name"]) not in keep)
