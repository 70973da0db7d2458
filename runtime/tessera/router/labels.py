"""The labels the operator puts on rank pods (operator/tessera_operator/naming.py), copied: the
runtime never imports the operator. tests/router/test_labels.py holds them equal."""

from __future__ import annotations

CLUSTER_LABEL = "tessera.dev/cluster"
ROLE_LABEL = "tessera.dev/role"
LEADER = "leader"
MANAGED_BY = {"app.kubernetes.io/managed-by": "tessera-operator"}
# Set by the operator on a leader it is about to delete: the router sends it nothing new.
LEAVING_LABEL = "tessera.dev/leaving"


def leader_pod_selector(cluster: str) -> str:
    """The label selector of an InferenceCluster's group leaders (the pods that serve HTTP), as
    the operator's client Service selects them (naming.rank_leader_selector)."""
    labels = {CLUSTER_LABEL: cluster, **MANAGED_BY, ROLE_LABEL: LEADER}
    return ",".join(f"{key}={value}" for key, value in labels.items())
