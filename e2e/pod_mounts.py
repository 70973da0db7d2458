"""A container's filesystem view as the kubelet and the image would give it, in a mount namespace.

Each container runs under `unshare --mount` (private propagation), and a short shell prologue
bind-mounts every emptyDir of the pod (a folder under the pod's state dir; `medium: Memory` is a
tmpfs) at its mountPath, the image's baked-in artefacts (the host's Tessera cache, read-only, at
/opt/tessera/cache), and remounts the root read-only when the container asks for it. The mounts
live only in that namespace, so they vanish with the container's last process: nothing to undo.
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Where the runtime image keeps its prebuilt model conversions and CPU kernels (images/runtime-cpu.Dockerfile).
IMAGE_PREBUILT_DIR = "/opt/tessera/cache"
MEMORY_TMPFS_SIZE = "256m"
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
        if "emptyDir" not in volume:
            log.warning("volume %r is not an emptyDir: not mounted by the node agent", mount["name"])
        elif (volume["emptyDir"] or {}).get("medium") == "Memory":
            mounts.append(Mount(mount["mountPath"], None, read_only))
        else:
            folder = pod_dir / "volumes" / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(mount["mountPath"], str(folder), read_only))
    return mounts


def ensure_mount_points(mounts: list[Mount]) -> None:
    """Creates missing mount points on the host (an image would have them; they stay, empty)."""
    for mount in mounts:
        Path(mount.target).mkdir(parents=True, exist_ok=True)


def mount_prologue(mounts: list[Mount], read_only_root: bool) -> str:
    """Shell commands run inside the container's mount namespace before its command."""
    lines = [m.shell() for m in mounts]
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
