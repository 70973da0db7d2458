"""A container's filesystem view as the kubelet and the image would give it, in a mount namespace.

Each container runs under `unshare --mount` (private propagation), and a short shell prologue
bind-mounts every emptyDir of the pod (a folder under the pod's state dir; `medium: Memory` is a
tmpfs) and every secret and projected volume (its files written as the kubelet projects them, a
ServiceAccount token included, and bound read-only) at its mountPath, the image's baked-in
artefacts (the host's Tessera cache, read-only, at /opt/tessera/cache), and remounts the root read-only when the container asks for it. The mounts
live only in that namespace, so they vanish with the container's last process: nothing to undo.

The host folders that stand for the image's programs (the project with its venv, the Python it
runs on) stay visible at their own paths even when a volume is mounted over a parent of theirs
(a checkout under /tmp, and a /tmp emptyDir): they are bound aside first and back on top after.
"""

from __future__ import annotations

import base64
import logging
import os
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from e2e.container_spec import ContainerConfigError, field_value, resource_field_value
from e2e.kube_api import KubeApi

# Where the runtime image keeps its prebuilt model conversions and CPU kernels (images/runtime-cpu.Dockerfile).
IMAGE_PREBUILT_DIR = "/opt/tessera/cache"
MEMORY_TMPFS_SIZE = "256m"
# Where image folders hidden by a volume wait (in the container's namespace) while volumes mount.
IMAGE_STASH_DIR = "/opt/tessera/host"
PROJECT_ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("node-agent")


def host_tessera_cache() -> Path:
    """What stands for the image's baked-in artefacts: this machine's Tessera cache."""
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


@dataclass(frozen=True)
class Mount:
    target: str
    source: str | None  # None: a fresh tmpfs
    read_only: bool = False

    def shell(self) -> str:
        target = shlex.quote(self.target)
        if self.source is None:
            return f"mount -t tmpfs -o size={MEMORY_TMPFS_SIZE} tmpfs {target}"
        options = "-o ro " if self.read_only else ""
        return f"mount --bind {options}{shlex.quote(self.source)} {target}"


def image_paths() -> list[str]:
    """Host folders that stand for the image's programs: the project (editable sources and its
    venv) and the Python installation the venv runs on; none inside another."""
    candidates = {PROJECT_ROOT, Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return sorted(
        str(path)
        for path in candidates
        if not any(path != other and path.is_relative_to(other) for other in candidates)
    )


def container_mounts(pod: Mapping[str, Any], container: Mapping[str, Any], pod_dir: Path) -> list[Mount]:
    """The image's prebuilt cache, then each of the container's volumeMounts the agent can serve."""
    mounts = []
    prebuilt = host_tessera_cache()
    if prebuilt.is_dir():
        mounts.append(Mount(IMAGE_PREBUILT_DIR, str(prebuilt), read_only=True))
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(mount["name"], {})
        read_only = bool(mount.get("readOnly"))
        if "secret" in volume or "projected" in volume:  # written by write_volumes; always read-only
            mounts.append(Mount(mount["mountPath"], str(_volume_dir(pod_dir, volume)), True))
        elif "persistentVolumeClaim" in volume:  # linked by link_claim_volumes before it starts
            read_only = read_only or bool(volume["persistentVolumeClaim"].get("readOnly"))
            mounts.append(Mount(mount["mountPath"], str(_claim_link(pod_dir, mount["name"])), read_only))
        elif "emptyDir" not in volume:
            log.warning(
                "volume %r is no emptyDir, secret, projected or claim volume: not mounted by the node agent",
                mount["name"],
            )
        elif (volume["emptyDir"] or {}).get("medium") == "Memory":
            mounts.append(Mount(mount["mountPath"], None, read_only))
        else:
            folder = pod_dir / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(mount["mountPath"], str(folder), read_only))
    return mounts


def _volume_dir(pod_dir: Path, volume: Mapping[str, Any]) -> Path:
    kind = "secret" if "secret" in volume else "projected"
    return pod_dir / f"{kind}-volumes" / volume["name"]


# What the API server's bound token volume (BoundServiceAccountTokenVolume) asks for when the
# projection gives no lifetime, as the kubelet defaults it.
TOKEN_EXPIRATION_SECONDS = 3600
File = tuple[str, bytes, int]  # path in the volume, content, mode


async def write_volumes(api: KubeApi, pod: Mapping[str, Any], pod_dir: Path) -> None:
    """As the kubelet, read afresh at every container start: each secret volume's keys (or its
    `items`), and each projected volume's sources (secrets, ConfigMaps, the downward API, and a
    ServiceAccount token the TokenRequest API issues bound to this pod), as files of their modes.
    A missing object or key keeps the pod from starting (the kubelet's MountVolume.SetUp
    failure), unless its source is optional."""
    for volume in pod["spec"].get("volumes") or []:
        if "secret" in volume:
            source = volume["secret"]
            mode = int(source.get("defaultMode", 0o644))
            files = await _keyed_files(api, pod, "secret", source["secretName"], source, mode)
        elif "projected" in volume:
            files = []
            mode = int(volume["projected"].get("defaultMode", 0o644))
            for projection in volume["projected"].get("sources") or []:
                files += await _projected_files(api, pod, projection, mode)
        else:
            continue
        folder = _volume_dir(pod_dir, volume)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, mode=0o755)
        for relative, content, file_mode in files:
            path = folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            path.chmod(file_mode)


async def _projected_files(
    api: KubeApi, pod: Mapping[str, Any], projection: Mapping[str, Any], mode: int
) -> list[File]:
    if "secret" in projection or "configMap" in projection:
        kind = "secret" if "secret" in projection else "configMap"
        source = projection[kind]
        return await _keyed_files(api, pod, kind, source["name"], source, mode)
    if "downwardAPI" in projection:
        return [
            (item["path"], _downward_value(pod, item).encode(), int(item.get("mode", mode)))
            for item in projection["downwardAPI"].get("items") or []
        ]
    if "serviceAccountToken" in projection:
        source = projection["serviceAccountToken"]
        return [(source["path"], (await request_token(api, pod, source)).encode(), mode)]
    raise ContainerConfigError(f"unsupported projected volume source {sorted(projection)}")


async def _keyed_files(
    api: KubeApi, pod: Mapping[str, Any], kind: str, name: str, source: Mapping[str, Any], mode: int
) -> list[File]:
    """The keys of a Secret or ConfigMap (all, or the `items` asked for) as files."""
    namespace = pod["metadata"]["namespace"]
    item = await api.get_or_none(f"/api/v1/namespaces/{namespace}/{kind.lower()}s/{name}")
    if item is None:
        if source.get("optional"):
            return []
        raise ContainerConfigError(f"{kind} {name!r} of a volume not found")
    if kind == "secret":
        data = {k: base64.b64decode(v) for k, v in (item.get("data") or {}).items()}
    else:
        data = {k: str(v).encode() for k, v in (item.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (item.get("binaryData") or {}).items()})
    files = []
    for wanted in source.get("items") or [{"key": key, "path": key} for key in data]:
        if wanted["key"] not in data:
            if source.get("optional"):
                continue
            raise ContainerConfigError(f"{kind} {name!r} has no key {wanted['key']!r}")
        files.append((wanted["path"], data[wanted["key"]], int(wanted.get("mode", mode))))
    return files


def _downward_value(pod: Mapping[str, Any], item: Mapping[str, Any]) -> str:
    if "fieldRef" in item:
        return field_value(pod, item["fieldRef"]["fieldPath"])
    if "resourceFieldRef" in item:  # a volume's reference names its container
        return resource_field_value(pod, pod["spec"]["containers"][0], item["resourceFieldRef"])
    raise ContainerConfigError(f"unsupported downwardAPI item {sorted(item)}")


async def request_token(api: KubeApi, pod: Mapping[str, Any], source: Mapping[str, Any]) -> str:
    """A token of the pod's ServiceAccount from the TokenRequest API, bound to this pod (it stops
    authenticating once the pod is gone), for the projection's audience (else the API server's)."""
    meta = pod["metadata"]
    account = pod["spec"].get("serviceAccountName") or "default"
    body = {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenRequest",
        "spec": {
            "audiences": [source["audience"]] if source.get("audience") else [],
            "expirationSeconds": int(source.get("expirationSeconds", TOKEN_EXPIRATION_SECONDS)),
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]},
        },
    }
    path = f"/api/v1/namespaces/{meta['namespace']}/serviceaccounts/{account}/token"
    try:
        answer = await api.request("POST", path, body)
    except httpx.HTTPStatusError as error:
        raise ContainerConfigError(
            f"token of service account {account!r}: {error.response.status_code} {error.response.text[:200]}"
        ) from error
    return str(answer["status"]["token"])


def _claim_link(pod_dir: Path, volume: str) -> Path:
    return pod_dir / "claim-volumes" / volume


async def link_claim_volumes(api: KubeApi, pod: Mapping[str, Any], pod_dir: Path) -> None:
    """As the kubelet mounts a bound claim's volume: each persistentVolumeClaim volume's folder
    (its PersistentVolume's hostPath, e2e.local_provisioner's) linked under the pod's folder, so
    the mount prologue binds it. A claim not found or not bound keeps the pod from starting."""
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes") or []:
        source = volume.get("persistentVolumeClaim")
        if source is None:
            continue
        claim = await api.get_or_none(
            f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/{source['claimName']}"
        )
        bound = (claim or {}).get("spec", {}).get("volumeName")
        pv = await api.get_or_none(f"/api/v1/persistentvolumes/{bound}") if bound else None
        path = ((pv or {}).get("spec") or {}).get("hostPath", {}).get("path")
        if path is None:
            raise ContainerConfigError(
                f"persistentvolumeclaim {source['claimName']!r} of volume {volume['name']!r} is not "
                "bound to a hostPath volume"
            )
        link = _claim_link(pod_dir, volume["name"])
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(path, target_is_directory=True)


def ensure_mount_points(mounts: list[Mount]) -> None:
    """Creates missing mount points on the host (an image would have them; they stay, empty)."""
    for mount in mounts:
        Path(mount.target).mkdir(parents=True, exist_ok=True)


def mount_prologue(mounts: list[Mount], read_only_root: bool, keep_visible: Sequence[str] = ()) -> str:
    """Shell commands run inside the container's mount namespace before its command.

    Each folder of ``keep_visible`` that a mount would hide is bound aside before the mounts and
    back at its own path after them (read-only under a read-only root, as an image is)."""
    hidden = [path for path in keep_visible if any(Path(path).is_relative_to(m.target) for m in mounts)]
    stashes = [f"{IMAGE_STASH_DIR}/{i}" for i in range(len(hidden))]
    lines = [
        f"mkdir -p {s} && mount --bind {shlex.quote(p)} {s}" for p, s in zip(hidden, stashes, strict=True)
    ]
    # A volume over a folder that holds another's source (a /tmp emptyDir, the pod's state
    # under /tmp) goes after it, or that source would be hidden before it is bound.
    hides_a_source = [
        any(o is not m and o.source and Path(o.source).is_relative_to(m.target) for o in mounts)
        for m in mounts
    ]
    lines += [
        m.shell() for _, m in sorted(zip(hides_a_source, mounts, strict=True), key=lambda pair: pair[0])
    ]
    options = "-o ro " if read_only_root else ""
    lines += [
        f"mkdir -p {shlex.quote(p)} && mount --bind {options}{s} {shlex.quote(p)}"
        for p, s in zip(hidden, stashes, strict=True)
    ]
    if read_only_root:
        lines.append("mount -o remount,bind,ro /")
    return "".join(f"{line} && " for line in lines)


def working_dir(container: Mapping[str, Any], pod_dir: Path, mounts: list[Mount]) -> str:
    """The container's workingDir, else the pod's folder (it stands for the image's writable
    workdir), unless one of the mounts hides that folder (a /tmp emptyDir): then /."""
    if container.get("workingDir"):
        return str(container["workingDir"])
    hidden = any(pod_dir.is_relative_to(mount.target) for mount in mounts)
    return "/" if hidden else str(pod_dir)


def read_only_root(container: Mapping[str, Any]) -> bool:
    return bool((container.get("securityContext") or {}).get("readOnlyRootFilesystem"))
