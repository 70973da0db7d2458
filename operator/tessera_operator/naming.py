"""Stable names and labels of everything the operator owns (DNS-valid, derived, never random)."""

from __future__ import annotations

import re

LABEL_PREFIX = "tessera.dev/"
CLUSTER_LABEL = "tessera.dev/cluster"
GROUP_LABEL = "tessera.dev/group"
STAGE_LABEL = "tessera.dev/stage"
TP_RANK_LABEL = "tessera.dev/tp-rank"
ROLE_LABEL = "tessera.dev/role"
REVISION_LABEL = "tessera.dev/revision"
# On a leader the operator is about to delete: the router sends it nothing new (its preStop
# hook, `tessera drain`, then waits for what it has). runtime/tessera/router/labels.py copies it.
LEAVING_LABEL = "tessera.dev/leaving"
GROUP_SIZE_ANNOTATION = "tessera.dev/group-size"  # pods in the group, on each of its pods
MANAGED_BY = {"app.kubernetes.io/managed-by": "tessera-operator"}
LEADER, WORKER = "leader", "worker"
# Labels and annotations the operator writes on every pod; a spec cannot set keys of this form.
RESERVED_LABELS = frozenset(MANAGED_BY)
RESERVED_PREFIX = LABEL_PREFIX

# Volumes the operator adds to every rank pod. The root filesystem is read-only: the runtime
# writes its cache (converted models, compiled CPU kernels), temporary files (ZeroMQ IPC
# sockets, torch, the kernel compiler) and HOME into these emptyDirs.
SHM_VOLUME, CACHE_VOLUME, TMP_VOLUME = "dshm", "tessera-cache", "tessera-tmp"
SHM_DIR, CACHE_DIR, TMP_DIR = "/dev/shm", "/cache", "/tmp"
OPERATOR_VOLUMES = frozenset({SHM_VOLUME, CACHE_VOLUME, TMP_VOLUME})

# Pod hostnames are DNS-1123 labels (63 chars) and Service names DNS-1035 labels (start with a
# letter): `<cluster>-g<group>-s<stage>-t<tp>` must fit, which bounds the cluster name.
MAX_CLUSTER_NAME = 40
CLUSTER_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def pod_name(cluster: str, group: int, stage: int, tp_rank: int | None) -> str:
    """A rank's pod, `<cluster>-g<group>-s<stage>-t<tp>`; tp_rank None: the pod holding the
    stage's whole TP group (spec.template.ranksPerPod), `<cluster>-g<group>-s<stage>`."""
    if tp_rank is None:
        return f"{cluster}-g{group}-s{stage}"
    return f"{cluster}-g{group}-s{stage}-t{tp_rank}"


def headless_service_name(cluster: str) -> str:
    """The rendezvous Service; it is also every rank pod's subdomain."""
    return f"{cluster}-ranks"


def client_service_name(cluster: str) -> str:
    return cluster


def leader_dns(cluster: str, namespace: str, group: int, stage_pods: bool = False) -> str:
    """Stable DNS name of a group's rank-0 pod, resolvable before it is Ready (publishNotReadyAddresses);
    `stage_pods`: the group's pods each hold a whole stage."""
    leader = pod_name(cluster, group, 0, None if stage_pods else 0)
    return f"{leader}.{headless_service_name(cluster)}.{namespace}.svc"


def cluster_selector(cluster: str) -> dict[str, str]:
    return {CLUSTER_LABEL: cluster}


def leader_selector(cluster: str) -> dict[str, str]:
    return {CLUSTER_LABEL: cluster, ROLE_LABEL: LEADER}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def group_secret_name(cluster: str) -> str:
    """The Secret (owned by the InferenceCluster) holding each group's rank-traffic secret."""
    return f"{cluster}-group-secret"


def group_secret_key(group: int) -> str:
    """A group's key in that Secret: each rank pod mounts only its own group's key."""
    return f"group-{group}"


# The group secret's volume in every rank pod (key `group_secret_key(group)` only, as one file).
GROUP_SECRET_VOLUME = "tessera-group-secret"
OPERATOR_VOLUMES = OPERATOR_VOLUMES | {GROUP_SECRET_VOLUME}


def rank_selector(cluster: str) -> dict[str, str]:
    """The cluster's rank pods as the operator labels them: the cluster label and managed-by, which
    a spec cannot set (the pod policy reserves both). Services, NetworkPolicies and the budget
    select by it, so a pod an InferenceCluster author makes for another cluster never matches.
    Anyone who may create pods in the namespace can still set both labels (docs/SECURITY.md)."""
    return {CLUSTER_LABEL: cluster, **MANAGED_BY}


def rank_leader_selector(cluster: str) -> dict[str, str]:
    return {**rank_selector(cluster), ROLE_LABEL: LEADER}


def network_policy_names(cluster: str) -> tuple[str, str]:
    """(rank-to-rank, clients-to-leaders) NetworkPolicies of `spec.networkPolicy`."""
    return f"{cluster}-ranks", f"{cluster}-clients"


# The router's pods carry this label (its value: the cluster), not the cluster label: the rank
# selectors, the pod listing of a pass and the budget never count them as ranks.
ROUTER_LABEL = "tessera.dev/router"


def router_name(cluster: str) -> str:
    """The router's Deployment, ServiceAccount, Role and RoleBinding (spec.router)."""
    return f"{cluster}-router"


def router_selector(cluster: str) -> dict[str, str]:
    return {ROUTER_LABEL: cluster, **MANAGED_BY}


def pod_group_name(cluster: str, group: int, revision: str) -> str:
    """A replica group's gang at one revision (spec.scheduling): its Volcano PodGroup, or its Kueue
    pod group. Per revision: a rollout makes the new pods a new gang (their size may differ), and
    the old one goes with the old pods. At most 40 + 2 + 3 + 1 + 10 characters: a label value too."""
    return f"{cluster}-g{group}-{revision}"


# spec.model.cache: the shared model cache's volume (read-only in every rank container) and the
# claim the operator makes for it when the spec names none.
MODEL_CACHE_VOLUME, MODEL_CACHE_DIR = "tessera-model-cache", "/model-cache"
OPERATOR_VOLUMES = OPERATOR_VOLUMES | {MODEL_CACHE_VOLUME}


def model_cache_claim_name(cluster: str) -> str:
    return f"{cluster}-model-cache"
