"""The Volcano PodGroups of a cluster's groups (spec.scheduling), written before the pods that
name them: each made, rewritten or deleted with `write_owned`, as the router's objects are.

A pass lists the cluster's PodGroups only when one is wanted or a pod names one (so the default
scheduler costs no request): those no pod that stays names, and no group wants, are deleted in
the pass that deletes the last of their pods. The cluster's deletion takes the rest (owner).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tessera_operator import builders, naming
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.builders import ClusterRef
from tessera_operator.kube import ApiError, KubeClient, custom_path
from tessera_operator.pod_group_builders import (
    PODGROUP_GROUP,
    PODGROUP_VERSION,
    desired_pod_groups,
    stale_pod_groups,
)
from tessera_operator.reconcile.observe import controlled_by
from tessera_operator.reconcile.router_writes import write_owned


class SchedulerUnavailable(Exception):
    """Volcano is selected and the API server serves no PodGroup."""


def group_name_of(pod: dict[str, Any]) -> str | None:
    annotations = pod["metadata"].get("annotations") or {}
    return annotations.get(builders.VOLCANO_GROUP_ANNOTATION)


async def write_pod_groups(
    client: KubeClient,
    ref: ClusterRef,
    spec: InferenceClusterSpec,
    revision: str,
    pods: Iterable[dict[str, Any]],
    delete_pods: Iterable[str],
    create_groups: Iterable[int],
) -> None:
    """Raises SchedulerUnavailable, NotOurs(kind, name) or ApiError (the caller reports them)."""
    ours = [p for p in pods if controlled_by(p, ref.uid)]
    leaving = set(delete_pods)
    live = [
        p for p in ours if not p["metadata"].get("deletionTimestamp") and p["metadata"]["name"] not in leaving
    ]
    places = [
        (int(labels[naming.GROUP_LABEL]), labels.get(naming.REVISION_LABEL, ""))
        for p in live
        if (labels := p["metadata"].get("labels") or {}).get(naming.GROUP_LABEL, "").isdigit()
    ]
    desired = desired_pod_groups(ref, spec, revision, places, create_groups)
    named_by_live = {name for p in live if (name := group_name_of(p)) is not None}
    if not desired and not any(group_name_of(p) is not None for p in ours):
        return
    path = custom_path(PODGROUP_GROUP, PODGROUP_VERSION, ref.namespace, "podgroups")
    try:
        existing = await client.list(path, naming.selector_string(naming.cluster_selector(ref.name)))
    except ApiError as exc:
        if not desired and exc.status in (403, 404):
            return  # none wanted, and none could have been made
        if exc.status == 404:
            raise SchedulerUnavailable(
                f"spec.scheduling.scheduler: volcano, but the API server serves no "
                f"{PODGROUP_GROUP}/{PODGROUP_VERSION} PodGroup (install Volcano, or choose another "
                "scheduler); the groups' pods are not made until it does"
            ) from exc
        raise
    for name, body in desired.items():  # before the pods: Volcano reads a pod's group at once
        await write_owned(client, ref, path, name, "PodGroup", body)
    for name in stale_pod_groups(existing, desired, named_by_live):
        await write_owned(client, ref, path, name, "PodGroup", None)  # ours only: not_ours keeps
