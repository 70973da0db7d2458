"""The router's objects (spec.router), and its InferencePool, written: each made, rewritten or
deleted as `plan_owned` says.

Read by name (no list, no watch: the operator's Role needs get, create, update, delete only).
Without rights on them (a Role from before the router) and none wanted: nothing to do.
"""

from __future__ import annotations

from typing import Any

from tessera_operator import naming, router_builders
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.builders import ClusterRef
from tessera_operator.kube import ApiError, KubeClient, core_path, custom_path
from tessera_operator.reconcile.owned_plans import plan_owned, updated_owned

RBAC = "rbac.authorization.k8s.io"
# (kind, collection path of a namespace), in the order the router needs them.
KINDS: tuple[tuple[str, Any], ...] = (
    ("ServiceAccount", lambda ns: core_path(ns, "serviceaccounts")),
    ("Role", lambda ns: custom_path(RBAC, "v1", ns, "roles")),
    ("RoleBinding", lambda ns: custom_path(RBAC, "v1", ns, "rolebindings")),
    ("Deployment", lambda ns: custom_path("apps", "v1", ns, "deployments")),
)


async def write_router(client: KubeClient, ref: ClusterRef, spec: InferenceClusterSpec) -> None:
    """Raises ApiError (the caller turns refusals into Degraded), NotOurs(kind, name), or
    PoolUnavailable when an InferencePool is wanted and the API server has none of its kind."""
    desired = {body["kind"]: body for body in router_builders.build_router_objects(ref, spec)}
    name = naming.router_name(ref.name)
    for kind, collection in KINDS:
        await write_owned(client, ref, collection(ref.namespace), name, kind, desired.get(kind))
    pool = router_builders.build_inference_pool(ref, spec)
    group, version = router_builders.INFERENCE_POOL_GROUP, router_builders.INFERENCE_POOL_VERSION
    if pool is not None and not await served(client, f"/apis/{group}/{version}"):
        raise PoolUnavailable(
            f"spec.router.inferencePool: the API server serves no {group}/{version} (install the "
            "Gateway API inference extension's CRDs); no InferencePool made"
        )
    path = custom_path(group, version, ref.namespace, "inferencepools")
    await write_owned(client, ref, path, ref.name, "InferencePool", pool)


async def served(client: KubeClient, group_version_path: str) -> bool:
    try:
        await client.get(group_version_path)
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def write_owned(
    client: KubeClient, ref: ClusterRef, path: str, name: str, kind: str, want: dict[str, Any] | None
) -> None:
    """One object made, rewritten or deleted as `plan_owned` says."""
    try:
        have: dict[str, Any] | None = await client.get(f"{path}/{name}")
    except ApiError as exc:
        if exc.status == 404:
            have = None
        elif want is None and exc.status == 403:
            return  # never had rights on them, so never made one
        else:
            raise
    action = plan_owned(ref, want, have)
    if action == "not_ours":
        raise NotOurs(kind, name)
    if action == "create" and want is not None:
        await client.create(path, want)
    elif action == "update" and want is not None and have is not None:
        await client.request("PUT", f"{path}/{name}", body=updated_owned(have, want))
    elif action == "delete" and have is not None:
        await client.delete(f"{path}/{name}", uid=have["metadata"]["uid"])


class PoolUnavailable(Exception):
    """An InferencePool is wanted and its CRD is not installed."""


class NotOurs(Exception):
    def __init__(self, kind: str, name: str) -> None:
        super().__init__(kind, name)
        self.kind, self.name = kind, name
