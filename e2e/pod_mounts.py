"""A container's filesystem view as the kubelet and the image would give it, in a mount namespace.

Each container runs under `unshare --mount` (private propagation), and a short shell prologue
bind-mounts every emptyDir of the pod (a folder under the pod's state dir; `medium: Memory` is a
tmpfs) and every secret volume (its keys written as files, as the kubelet projects them, and bound
read-only) at its mountPath, the image's baked-in artefacts (the host's Tessera cache, read-only, at
/opt/tessera/cache), and remounts the root read-only when the container asks for it. The mounts
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

from e2e.container_spec import ContainerConfigError
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
        if "secret" in volume:  # written by write_secret_volumes before the container starts
            mounts.append(Mount(mount["mountPath"], str(_secret_dir(pod_dir, mount["name"])), True))
        elif "persistentVolumeClaim" in volume:  # linked by link_claim_volumes before it starts
            read_only = read_only or bool(volume["persistentVolumeClaim"].get("readOnly"))
            mounts.append(Mount(mount["mountPath"], str(_claim_link(pod_dir, mount["name"])), read_only))
        elif "emptyDir" not in volume:
            log.warning(
                "volume %r is neither an emptyDir nor a secret: not mounted by the node agent", mount["name"]
            )
        elif (volume["emptyDir"] or {}).get("medium") == "Memory":
            mounts.append(Mount(mount["mountPath"], None, read_only))
        else:
            folder = pod_dir / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(mount["mountPath"], str(folder), read_only))
    return mounts


def _secret_dir(pod_dir: Path, volume: str) -> Path:
    return pod_dir / "secret-volumes" / volume


async def write_secret_volumes(api: KubeApi, pod: Mapping[str, Any], pod_dir: Path) -> None:
    """As the kubelet: each secret volume's keys (or its `items`) as files of the volume's mode,
    read afresh at every container start. A missing Secret or key keeps the pod from starting
    (the kubelet's MountVolume.SetUp failure), unless the volume is optional."""
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes") or []:
        source = volume.get("secret")
        if source is None:
            continue
        secret = await api.get_or_none(f"/api/v1/namespaces/{namespace}/secrets/{source['secretName']}")
        data = {k: base64.b64decode(v) for k, v in ((secret or {}).get("data") or {}).items()}
        if secret is None and not source.get("optional"):
            raise ContainerConfigError(
                f"secret {source['secretName']!r} of volume {volume['name']!r} not found"
            )
        items = source.get("items") or [{"key": key, "path": key} for key in data]
        folder = _secret_dir(pod_dir, volume["name"])
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, mode=0o755)
        for item in items:
            if item["key"] not in data:
                if source.get("optional"):
                    continue
                raise ContainerConfigError(f"secret {source['secretName']!r} has no key {item['key']!r}")
            path = folder / item["path"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data[item["key"]])
            path.chmod(int(item.get("mode", source.get("defaultMode", 0o644))))


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
