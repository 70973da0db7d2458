"""The local cluster's storage: one StorageClass, `local-path` (the default), whose claims it binds
to folders on this machine, as a hostPath provisioner (Rancher's local-path) would.

It plays an external provisioner: a Pending claim of its class gets a PersistentVolume (a
hostPath folder under the node agent's state dir, `claimRef` naming the claim), and the genuine
kube-controller-manager's binder binds the two. A claim of any other class stays Pending, as on
a real cluster without that class. A released volume (its claim deleted) is removed with its
folder (reclaimPolicy Delete). Volumes carry no node affinity: every node of the local cluster
is this machine, so a folder serves pods on any of them (ReadWriteMany holds).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import httpx

from e2e.kube_api import KubeApi

STORAGE_CLASS = "local-path"
PROVISIONER = "tessera.dev/local-path"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
log = logging.getLogger("node-agent")


def storage_class() -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": STORAGE_CLASS, "annotations": {DEFAULT_CLASS_ANNOTATION: "true"}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def volume_for(claim: dict[str, Any], folder: Path) -> dict[str, Any]:
    meta, spec = claim["metadata"], claim["spec"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": f"pvc-{meta['uid']}", "annotations": {PROVISIONED_BY: PROVISIONER}},
        "spec": {
            "capacity": {"storage": spec["resources"]["requests"]["storage"]},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
            "storageClassName": STORAGE_CLASS,
            "persistentVolumeReclaimPolicy": "Delete",
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


class LocalProvisioner:
    def __init__(self, api: KubeApi, root: Path) -> None:
        self.api = api
        self.root = root

    async def register(self) -> None:
        try:
            await self.api.request("POST", "/apis/storage.k8s.io/v1/storageclasses", storage_class())
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 409:
                raise

    async def sync(self) -> None:
        claims = (await self.api.get("/api/v1/persistentvolumeclaims"))["items"]
        volumes = (await self.api.get("/api/v1/persistentvolumes"))["items"]
        made = {v["metadata"]["name"] for v in volumes}
        for claim in claims:
            spec, meta = claim["spec"], claim["metadata"]
            pending = (claim.get("status") or {}).get("phase") == "Pending" and not spec.get("volumeName")
            name = f"pvc-{meta['uid']}"
            if not pending or spec.get("storageClassName") != STORAGE_CLASS or name in made:
                continue
            folder = self.root / name
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o777)  # as local-path's folders: any pod's user writes it
            await self._create("/api/v1/persistentvolumes", volume_for(claim, folder))
            log.info("provisioned %s for claim %s/%s at %s", name, meta["namespace"], meta["name"], folder)
        for volume in volumes:
            ours = (volume["metadata"].get("annotations") or {}).get(PROVISIONED_BY) == PROVISIONER
            if ours and (volume.get("status") or {}).get("phase") in ("Released", "Failed"):
                shutil.rmtree(volume["spec"]["hostPath"]["path"], ignore_errors=True)
                try:
                    await self.api.request(
                        "DELETE", f"/api/v1/persistentvolumes/{volume['metadata']['name']}"
                    )
                except httpx.HTTPStatusError as error:
                    if error.response.status_code != 404:
                        raise

    async def _create(self, path: str, body: dict[str, Any]) -> None:
        try:
            await self.api.request("POST", path, body)
        except httpx.HTTPStatusError as error:
            if error.response.status_code != 409:
                raise
