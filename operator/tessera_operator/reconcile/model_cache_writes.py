"""spec.model.cache's claim written, and checked: made (owned by the cluster, so it goes with it),
deleted when the spec drops the cache, or, when the spec names an existing claim, only read.

Read by name (get, create, patch, delete: no list, no watch, no update, a claim's spec being
immutable once made). A claim that cannot bind for a reason the spec names (a StorageClass that
does not exist, a claim that is not there) is a WriteRefused: the cluster reads Degraded naming
the field, while its pods wait Pending (never a crash loop).
"""

from __future__ import annotations

from typing import Any

from tessera_operator import builders, model_cache, naming
from tessera_operator.api import InferenceClusterSpec
from tessera_operator.builders import ClusterRef
from tessera_operator.kube import ApiError, KubeClient, core_path
from tessera_operator.reconcile.observe import is_orphaned
from tessera_operator.reconcile.owned_plans import adoption
from tessera_operator.reconcile.router_writes import NotOurs, write_owned

MODEL_CACHE_UNAVAILABLE = "ModelCacheUnavailable"
STORAGE_CLASSES = "/apis/storage.k8s.io/v1/storageclasses"


class ModelCacheUnavailable(Exception):
    """The claim cannot serve the cluster, for a reason the spec names."""


async def write_model_cache(client: KubeClient, ref: ClusterRef, spec: InferenceClusterSpec) -> None:
    """Raises ModelCacheUnavailable, NotOurs, or ApiError (the caller turns both into Degraded)."""
    collection = core_path(ref.namespace, "persistentvolumeclaims")
    cache = spec.model.cache
    if cache is not None and cache.claim_name:  # the user's: read only
        claim = await _get(client, f"{collection}/{cache.claim_name}")
        if claim is None:
            raise ModelCacheUnavailable(
                f"spec.model.cache.claimName: PersistentVolumeClaim {cache.claim_name!r} not found in "
                f"namespace {ref.namespace}; the rank pods wait Pending until it exists"
            )
        await _check_bindable(client, claim, "spec.model.cache.claimName", cache.claim_name)
        return
    own = naming.model_cache_claim_name(ref.name)
    desired = model_cache.build_claim(ref.name, ref.namespace, spec, builders._owned_metadata(ref, own))
    # Without a cache, no read of our own first: write_owned deletes one left by an earlier spec,
    # and does nothing under a Role from before the cache (403, none wanted).
    have = await _get(client, f"{collection}/{own}") if desired is not None else None
    if desired is not None and have is not None and is_orphaned(have, ref.name):
        # left by an orphaning delete: adopted as it is (a PUT of our spec would drop volumeName)
        await client.merge_patch(f"{collection}/{own}", adoption(have, ref))
        return
    await write_owned(client, ref, collection, own, "PersistentVolumeClaim", desired)
    if desired is not None:
        claim = await _get(client, f"{collection}/{own}") or desired
        await _check_bindable(client, claim, "spec.model.cache.storageClassName", own)


async def _get(client: KubeClient, path: str) -> dict[str, Any] | None:
    try:
        return dict(await client.get(path))
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def _check_bindable(client: KubeClient, claim: dict[str, Any], field: str, name: str) -> None:
    """A Pending claim whose StorageClass does not exist never binds: say so. (Unreadable
    classes, a 403 under an older Role, are not judged.)"""
    phase = (claim.get("status") or {}).get("phase")
    if phase == "Lost":
        raise ModelCacheUnavailable(f"{field}: PersistentVolumeClaim {name!r} lost its volume")
    if phase == "Bound":
        return
    storage_class = (claim.get("spec") or {}).get("storageClassName")
    if not storage_class:
        return
    try:
        await client.get(f"{STORAGE_CLASSES}/{storage_class}")
    except ApiError as exc:
        if exc.status == 404:
            raise ModelCacheUnavailable(
                f"{field}: StorageClass {storage_class!r} does not exist: PersistentVolumeClaim "
                f"{name!r} stays Pending and the rank pods with it"
            ) from exc
        if exc.status != 403:
            raise


__all__ = ["MODEL_CACHE_UNAVAILABLE", "ModelCacheUnavailable", "NotOurs", "write_model_cache"]
