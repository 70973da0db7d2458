"""Read the pods that exist into per-group facts: complete? started? failed (and why)? leader Ready?

Pure: plain pod dicts in, frozen facts out. Pods being deleted count as absent. Only pods this
cluster controls (their controller ownerReference carries its uid) are ours: among those, one
outside the naming scheme is a stray for removal; any other pod with the cluster label (a Job's,
a `kubectl debug --copy-to` copy, a client labelled to pass a NetworkPolicy) is ignored, as a
ReplicaSet ignores pods it does not control.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tessera_operator import naming
from tessera_operator.timeutil import from_rfc3339

POD_DELETED = "PodDeleted"  # a started group misses pods: someone removed them
POD_EVICTED = "PodEvicted"  # the kubelet took a pod off its node (memory pressure, shutdown)
# Failed pods' reasons that are the node's doing, not the rank's: node-pressure eviction, critical
# pod preemption, graceful node shutdown (its reason differs across Kubernetes versions).
NODE_REASONS = frozenset({"Evicted", "Preempting", "Shutdown", "NodeShutdown", "Terminated"})


@dataclass
class GroupObservation:
    index: int
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    terminating: list[str] = field(default_factory=list)
    # The earliest deletionTimestamp among them: when the first one's grace period ran out.
    terminating_deadline: float | None = None

    @property
    def revisions(self) -> set[str]:
        return {p["metadata"]["labels"].get(naming.REVISION_LABEL, "") for p in self.pods.values()}

    @property
    def revision(self) -> str | None:
        """The group's revision when all its pods agree, else None."""
        revisions = self.revisions
        return next(iter(revisions)) if len(revisions) == 1 else None

    @property
    def expected_size(self) -> int | None:
        sizes = {
            p["metadata"].get("annotations", {}).get(naming.GROUP_SIZE_ANNOTATION) for p in self.pods.values()
        }
        if len(sizes) != 1:
            return None
        size = next(iter(sizes))
        return int(size) if size and size.isdigit() else None

    @property
    def complete(self) -> bool:
        return self.revision is not None and self.expected_size == len(self.pods)

    @property
    def started(self) -> bool:
        """Some rank already runs (or ran): it joined a rendezvous that a missing rank has broken."""
        return any(
            p.get("status", {}).get("phase") in ("Running", "Succeeded", "Failed") for p in self.pods.values()
        )

    @property
    def leader(self) -> dict[str, Any] | None:
        return next((pod for pod in self.pods.values() if is_leader(pod)), None)

    @property
    def leader_ready(self) -> bool:
        leader = self.leader
        return leader is not None and pod_ready(leader)

    @property
    def all_running(self) -> bool:
        return bool(self.pods) and all(
            p.get("status", {}).get("phase") == "Running" for p in self.pods.values()
        )

    def start_problem(self) -> str | None:
        """The first pod of the group that cannot start, and why (see `start_problem`)."""
        for name in sorted(self.pods):
            problem = start_problem(self.pods[name])
            if problem:
                return f"{name}: {problem}"
        return None

    def failure(self, was_complete: bool = True) -> str | None:
        """Why this group must restart, or None. A serving rank that exits at all has failed.

        Missing pods are a disruption only in a group that was complete (`was_complete`): in one
        still being created (a quota or a policy refused some ranks) they are not there yet.
        A pod evicted or deleted comes before any peer's exit: the leader exits non-zero soon
        after a rank is taken away, and that is the eviction's doing, not a crash.
        """
        failures = [
            f"{name}: {reason}" for name in sorted(self.pods) if (reason := pod_failure(self.pods[name]))
        ]
        evicted = next((failure for failure in failures if is_disruption(failure)), None)
        if evicted is not None:
            return evicted
        size = self.expected_size
        if was_complete and self.started and size is not None and len(self.pods) < size:
            return f"{POD_DELETED}: {size - len(self.pods)} of {size} pods missing"
        return failures[0] if failures else None


# Container states that do not pass by waiting: a person (or a new spec) must act.
STUCK_WAITING_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)


def start_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod that has not failed does not start: it cannot be scheduled, or its container
    cannot be created (an image that cannot be pulled, a missing ConfigMap); None otherwise."""
    status = pod.get("status") or {}
    for condition in status.get("conditions") or []:
        unschedulable = condition.get("type") == "PodScheduled" and condition.get("status") == "False"
        if unschedulable and condition.get("reason") == "Unschedulable":
            return f"Unschedulable: {(condition.get('message') or '')[:300]}"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING_REASONS:
            return f"{waiting['reason']}: {(waiting.get('message') or '')[:300]}"
    return None


def is_disruption(failure: str) -> bool:
    """A rank removed from outside (evicted by a drain, preempted, deleted), not one that failed."""
    return failure.startswith(POD_DELETED) or failure.partition(": ")[2].startswith(POD_EVICTED)


def pod_failure(pod: dict[str, Any]) -> str | None:
    status = pod.get("status", {})
    phase = status.get("phase")
    if phase == "Failed" and status.get("reason") in NODE_REASONS:  # its containers were killed too
        return f"{POD_EVICTED}: {status['reason']}: {(status.get('message') or '')[:300]}"
    init_failure = init_container_failure(status)
    if init_failure is not None:
        return init_failure
    for cs in status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated and terminated.get("exitCode", 0) != 0:
            why = terminated.get("reason") or "Error"
            return f"ContainerTerminated: {cs.get('name')} {why} (exit code {terminated.get('exitCode')})"
    if phase == "Failed":
        return f"PodFailed: {status.get('reason') or status.get('message') or 'Failed'}"
    if phase == "Succeeded":
        return "PodExited: a rank exited"
    return None


def init_container_failure(status: dict[str, Any]) -> str | None:
    """An init container that failed (spec.model.cache's fill or wait): its name, exit code and
    termination message (its last log line with FallbackToLogsOnError), which say why."""
    for cs in status.get("initContainerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
            "terminated"
        )
        if terminated and terminated.get("exitCode", 0) != 0:
            message = (terminated.get("message") or "").strip().splitlines()
            why = f": {message[-1][:300]}" if message else ""
            return (
                f"InitContainerFailed: {cs.get('name')} {terminated.get('reason') or 'Error'} "
                f"(exit code {terminated.get('exitCode')}){why}"
            )
    return None


@dataclass
class Observation:
    groups: dict[int, GroupObservation]
    strays: list[str]  # controlled by this cluster, but not a pod it would create: removed


def running_revisions(pods: Iterable[dict[str, Any]]) -> set[str]:
    """The revisions the pods are labelled with."""
    return {p["metadata"].get("labels", {}).get(naming.REVISION_LABEL, "") for p in pods}


def pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def router_serves(deployment: dict[str, Any], uid: str) -> bool:
    """The cluster's own router Deployment has a Ready pod."""
    ready = (deployment.get("status") or {}).get("readyReplicas") or 0
    return controlled_by(deployment, uid) and int(ready) >= 1


def is_leader(pod: dict[str, Any]) -> bool:
    return bool((pod["metadata"].get("labels") or {}).get(naming.ROLE_LABEL) == naming.LEADER)


def controlled_by(pod: dict[str, Any], uid: str) -> bool:
    """Whether the pod's controller is the object with this uid (a label anyone can set; this not)."""
    owners = pod["metadata"].get("ownerReferences") or []
    return any(o.get("controller") is True and o.get("uid") == uid for o in owners)


def is_orphaned(obj: dict[str, Any], cluster: str) -> bool:
    """An object this operator made for the cluster (its labels say so) that no controller owns:
    what `kubectl delete ic NAME --cascade=orphan` leaves for the next InferenceCluster of that
    name to adopt."""
    meta = obj["metadata"]
    labels = meta.get("labels") or {}
    if meta.get("deletionTimestamp") or labels.get(naming.CLUSTER_LABEL) != cluster:
        return False
    if any(o.get("controller") is True for o in meta.get("ownerReferences") or []):
        return False
    return all(labels.get(key) == value for key, value in naming.MANAGED_BY.items())


def is_orphan(pod: dict[str, Any], cluster: str) -> bool:
    """An orphaned rank pod of this cluster, by its labels and its very name. Any other pod that
    carries the labels (a client, a debug copy) is left alone."""
    return is_orphaned(pod, cluster) and rank_of(pod, cluster) is not None


def rank_of(pod: dict[str, Any], cluster: str) -> tuple[int, int, int | None] | None:
    """(group, stage, tp rank) of a pod whose labels say so and whose name is the one the cluster
    gives that rank (tp rank None: a pod holding its stage's whole TP group, which has no TP
    rank label); None for any other pod."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    try:
        group = int(labels[naming.GROUP_LABEL])
        stage = int(labels[naming.STAGE_LABEL])
        tp = int(labels[naming.TP_RANK_LABEL]) if naming.TP_RANK_LABEL in labels else None
    except (KeyError, ValueError):
        return None
    return (group, stage, tp) if meta["name"] == naming.pod_name(cluster, group, stage, tp) else None


def observe(cluster: str, uid: str, pods: Iterable[dict[str, Any]]) -> Observation:
    groups: dict[int, GroupObservation] = {}
    strays: list[str] = []
    for pod in pods:
        if not controlled_by(pod, uid):
            continue  # not ours to count or delete, whatever its labels say
        meta = pod["metadata"]
        rank = rank_of(pod, cluster)
        if rank is None:
            strays.append(meta["name"])
            continue
        obs = groups.setdefault(rank[0], GroupObservation(rank[0]))
        if meta.get("deletionTimestamp"):
            obs.terminating.append(meta["name"])
            deadline = from_rfc3339(meta["deletionTimestamp"])
            if deadline is not None and (
                obs.terminating_deadline is None or deadline < obs.terminating_deadline
            ):
                obs.terminating_deadline = deadline
        else:
            obs.pods[meta["name"]] = pod
    return Observation(groups, strays)
