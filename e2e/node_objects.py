"""The Node object a node on this machine registers, and its Ready status (shared by the fake node
of `LocalCluster` and the node agent's nodes)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

DEFAULT_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "0"}


def node_object(name: str) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def node_ready_status(
    address: str, message: str, capacity: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A strategic-merge patch body for `nodes/NAME/status`: capacity, address, Ready=True."""
    capacity = dict(capacity or DEFAULT_CAPACITY)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "KubeletReady",
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }
    return {
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [{"type": "InternalIP", "address": address}],
            "conditions": [ready],
        }
    }
