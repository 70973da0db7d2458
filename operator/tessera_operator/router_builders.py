"""Pure functions: an InferenceCluster spec -> its router's objects (spec.router; docs/router.md).

The router is a Deployment running `tessera router --kube-cluster <name> --model <source>` from
the ranks' image, confined as the rank pods are (it reads the model's tokenizer, never its
weights, from where the ranks find the model: the image's prebuilt cache, or the template's
volume that holds a model path, mounted read-only), with a ServiceAccount of its own whose namespaced Role lets it
list and watch pods (all it asks the API: kube_source.py) and nothing else. Every object is
owned by the InferenceCluster: deleting the cluster deletes them.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import PurePosixPath
from typing import Any

from tessera.topology import DEFAULT_API_PORT
from tessera_operator import naming
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.builders import (
    HEALTH_PATH,
    ClusterRef,
    container_security_context,
    owner_reference,
    pod_security_context,
)

ROUTER_CONTAINER = "router"
# Hash of the desired object on the object: a pass rewrites it only when ours changed (what the
# API server adds, defaults of a Deployment, never reads as drift).
SPEC_HASH_ANNOTATION = "tessera.dev/spec-hash"
# What the router asks the Kubernetes API: list then watch the leader pods (kube_source.py).
ROUTER_POD_VERBS = ("list", "watch")


def router_labels(ref: ClusterRef) -> dict[str, str]:
    return naming.router_selector(ref.name)


def _metadata(ref: ClusterRef) -> dict[str, Any]:
    return {
        "name": naming.router_name(ref.name),
        "namespace": ref.namespace,
        # The cluster label too (an orphan of ours is told by it); the router's pods have none.
        "labels": {**router_labels(ref), naming.CLUSTER_LABEL: ref.name},
        "ownerReferences": [owner_reference(ref)],
    }


def router_args(ref: ClusterRef, spec: InferenceClusterSpec) -> list[str]:
    """The router's flags: the leaders of this cluster, the model whose tokenizer gives the
    prompts' block hashes (prefix scoring) with the leaders' block size, its hold-at-zero limits."""
    router = spec.router
    return [
        "--kube-cluster", ref.name,
        "--kube-namespace", ref.namespace,
        "--upstream-port", str(DEFAULT_API_PORT),
        "--port", str(DEFAULT_API_PORT),
        "--model", spec.model.source,
        "--block-size", str(spec.engine.block_size),
        "--hold-max", str(router.max_held_requests),
        "--hold-timeout", f"{router.hold_seconds:g}",
    ]  # fmt: skip


def model_volumes(spec: InferenceClusterSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, read-only mounts) of the template's that hold spec.model.source when it is a
    path (a Hugging Face folder or .gguf file on a volume); none for an alias (the image has it)."""
    source = PurePosixPath(spec.model.source)
    if not source.is_absolute():
        return [], []
    template = spec.template
    mounts = [
        {**copy.deepcopy(mount), "readOnly": True}
        for mount in template.volume_mounts
        if mount.get("mountPath")
        and source.is_relative_to(str(mount["mountPath"]))
        and mount.get("name") not in naming.OPERATOR_VOLUMES
    ]
    names = {mount["name"] for mount in mounts}
    return [copy.deepcopy(v) for v in template.volumes if v.get("name") in names], mounts


def router_container(ref: ClusterRef, spec: InferenceClusterSpec) -> dict[str, Any]:
    template = spec.template
    _, model_mounts = model_volumes(spec)
    return {
        "name": ROUTER_CONTAINER,
        "image": template.image,
        "imagePullPolicy": template.image_pull_policy,
        "command": ["tessera", "router"],
        "args": router_args(ref, spec),
        "env": [{"name": "HOME", "value": naming.TMP_DIR}, {"name": "TMPDIR", "value": naming.TMP_DIR}],
        "ports": [{"name": "http", "containerPort": DEFAULT_API_PORT, "protocol": "TCP"}],
        "resources": copy.deepcopy(spec.router.resources or {}),
        "volumeMounts": [{"name": naming.TMP_VOLUME, "mountPath": naming.TMP_DIR}, *model_mounts],
        # 200 at zero endpoints too: a router pod is Ready while it runs (it holds requests itself).
        "readinessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": HEALTH_PATH, "port": "http"}, "periodSeconds": 10},
        "securityContext": container_security_context(),
    }


def build_router_deployment(ref: ClusterRef, spec: InferenceClusterSpec) -> dict[str, Any]:
    template = spec.template
    pod_spec: dict[str, Any] = {
        "serviceAccountName": naming.router_name(ref.name),
        "automountServiceAccountToken": True,  # it watches the leader pods
        "enableServiceLinks": False,
        # Held requests and open streams: the router finishes them on SIGTERM within this.
        "terminationGracePeriodSeconds": int(spec.router.hold_seconds) + 30,
        "securityContext": pod_security_context(),
        "containers": [router_container(ref, spec)],
        "volumes": [{"name": naming.TMP_VOLUME, "emptyDir": {}}, *model_volumes(spec)[0]],
    }
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": secret} for secret in template.image_pull_secrets]
    if template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    if template.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(template.tolerations)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(ref),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_labels(ref)},
            "template": {"metadata": {"labels": router_labels(ref)}, "spec": pod_spec},
        },
    }


def build_router_service_account(ref: ClusterRef) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(ref)}


def build_router_role(ref: ClusterRef) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(ref),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": list(ROUTER_POD_VERBS)}],
    }


def build_router_role_binding(ref: ClusterRef) -> dict[str, Any]:
    name = naming.router_name(ref.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(ref),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ref.namespace}],
    }


INFERENCE_POOL_GROUP, INFERENCE_POOL_VERSION = "inference.networking.k8s.io", "v1"


def build_inference_pool(ref: ClusterRef, spec: InferenceClusterSpec) -> dict[str, Any] | None:
    """The InferencePool of the cluster's leaders (spec.router.inferencePool), or None: a Gateway's
    Endpoint Picker chooses among the pods it selects, on their API port."""
    router = spec.router
    if not router.inference_pool or router.endpoint_picker is None:
        return None
    picker = router.endpoint_picker
    body: dict[str, Any] = {
        "apiVersion": f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": {**_metadata(ref), "name": ref.name},
        "spec": {
            "selector": {"matchLabels": naming.rank_leader_selector(ref.name)},
            "targetPorts": [{"number": DEFAULT_API_PORT}],
            "endpointPickerRef": {
                "name": picker.name,
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }
    body["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(body)}
    return body


def build_router_objects(ref: ClusterRef, spec: InferenceClusterSpec) -> list[dict[str, Any]]:
    """The router's objects in the order they are needed (the Deployment's pods need the rest),
    each with its spec hash; none when spec.router is off."""
    if not spec.router.enabled:
        return []
    objects = [
        build_router_service_account(ref),
        build_router_role(ref),
        build_router_role_binding(ref),
        build_router_deployment(ref, spec),
    ]
    for body in objects:
        body["metadata"]["annotations"] = {SPEC_HASH_ANNOTATION: spec_hash(body)}
    return objects


def spec_hash(body: dict[str, Any]) -> str:
    """The hash of what the operator sets on an object (all but its metadata's server fields)."""
    mine = {k: v for k, v in body.items() if k != "metadata"}
    mine["labels"] = body["metadata"].get("labels")
    return hashlib.sha256(json.dumps(mine, sort_keys=True).encode()).hexdigest()[:12]
