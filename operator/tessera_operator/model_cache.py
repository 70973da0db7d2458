"""spec.model.cache, pure: the claim the operator makes, and what it adds to each rank pod.

Each group's leader pod gets an init container, `tessera model-cache fill`, that converts the
model into the claim (mounted read-write there only) with the runtime's .complete marker, under
the conversion's file lock and an atomic rename: two groups filling at once convert once, and a
filled cache makes the fill a no-op. Every other rank pod gets `tessera model-cache wait`, which
waits (bounded) for that marker with the claim read-only. Waiting in an init container, not in
the rank: a worker whose leader fills for minutes would otherwise spend its rendezvous timeout
and fail the group; this way a worker starts only with the model in place. One filler per group,
the leader: a group that cannot fill fails as a whole (its leader pod fails; status names the
init container's last log line), and a fill is retried with the group's restart backoff.
Every rank container mounts the claim read-only and finds the conversion through
$TESSERA_MODEL_CACHE (runtime/tessera/models/shared_cache.py).
"""

from __future__ import annotations

import copy
from typing import Any

from tessera_operator import naming
from tessera_operator.api import InferenceClusterSpec

FILL_CONTAINER, WAIT_CONTAINER = "model-cache-fill", "model-cache-wait"
MODEL_CACHE_ENV = "TESSERA_MODEL_CACHE"
WAIT_ENV = "TESSERA_MODEL_CACHE_WAIT_SECONDS"  # tessera.models.shared_cache.WAIT_ENV


def claim_name(cluster: str, spec: InferenceClusterSpec) -> str | None:
    cache = spec.model.cache
    if cache is None:
        return None
    return cache.claim_name or naming.model_cache_claim_name(cluster)


def build_claim(
    cluster: str, namespace: str, spec: InferenceClusterSpec, metadata: dict[str, Any]
) -> dict[str, Any] | None:
    """The claim the operator makes (owned by the cluster: `metadata`), or None: no cache, or the
    spec names an existing claim."""
    cache = spec.model.cache
    if cache is None or cache.claim_name:
        return None
    claim_spec: dict[str, Any] = {
        "accessModes": list(cache.access_modes),
        "resources": {"requests": {"storage": cache.size}},
    }
    if cache.storage_class_name:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": metadata, "spec": claim_spec}


def add_to_pod(pod: dict[str, Any], cluster: str, spec: InferenceClusterSpec, leader: bool) -> None:
    """The claim's volume, its read-only mount and $TESSERA_MODEL_CACHE in the rank container, and
    the fill (leader) or wait (other ranks) init container."""
    name = claim_name(cluster, spec)
    cache = spec.model.cache
    if name is None or cache is None:
        return
    pod_spec = pod["spec"]
    pod_spec["volumes"].append(
        {"name": naming.MODEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": name}}
    )
    rank = pod_spec["containers"][0]
    env = [
        {"name": MODEL_CACHE_ENV, "value": naming.MODEL_CACHE_DIR},
        {"name": WAIT_ENV, "value": f"{cache.wait_seconds:g}"},
    ]
    rank["env"] = [e for e in rank["env"] if e["name"] not in (MODEL_CACHE_ENV, WAIT_ENV)] + env
    read_only = {"name": naming.MODEL_CACHE_VOLUME, "mountPath": naming.MODEL_CACHE_DIR, "readOnly": True}
    rank["volumeMounts"] = [*rank["volumeMounts"], read_only]
    step = FILL_CONTAINER if leader else WAIT_CONTAINER
    init = {
        "name": step,
        "image": rank["image"],
        "imagePullPolicy": rank["imagePullPolicy"],
        "command": ["tessera", "model-cache", "fill" if leader else "wait", spec.model.source],
        "env": copy.deepcopy(rank["env"]),
        # Without the GPUs: a fill or a wait computes on the CPU.
        "resources": copy.deepcopy(spec.template.resources or {}),
        "volumeMounts": [
            *(m for m in copy.deepcopy(rank["volumeMounts"]) if m["name"] != naming.MODEL_CACHE_VOLUME),
            {**read_only, "readOnly": not leader},
        ],
        "securityContext": copy.deepcopy(rank["securityContext"]),
        # Its last log line (the reason it failed) becomes the termination message status shows.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod_spec["initContainers"] = [*(pod_spec.get("initContainers") or []), init]
