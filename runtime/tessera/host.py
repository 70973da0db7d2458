"""Facts about the machine this process runs on: its CPUs, its container's CPU limit, the CPU's
model and flags, and where Tessera keeps its caches. Read by every layer, so it imports none."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# This process's CPUs, read before anything pins a thread: pinning narrows the calling
# thread's own mask, which a second engine in the same process would otherwise read.
PROCESS_CPUS: frozenset[int] = frozenset(
    os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
)
CGROUP_ROOT = Path("/sys/fs/cgroup")
# An image bakes conversions and kernels in here (read-only), so pods do not redo them on start.
DEFAULT_PREBUILT_CACHE = "/opt/tessera/cache"


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """Whole CPUs of this container's CPU limit (cgroup v2 `cpu.max`, v1 CFS quota), at least 1;
    None when unlimited or unknown. A pod limited to 4 CPUs on a 64-core node still sees all 64
    in its affinity mask, and 64 threads there would spend most of each period throttled."""
    try:
        if (root / "cpu.max").exists():
            quota, period = (root / "cpu.max").read_text().split()[:2]
        else:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        if quota in ("max", "-1"):
            return None
        return max(1, int(quota) // int(period))  # rounded down: a partial CPU would throttle a thread
    except (OSError, ValueError):
        return None


@functools.cache  # read at import and for the kernels' build key; /proc/cpuinfo of a big node is large
def cpu_features() -> str:
    """The first processor's ``flags`` line of ``/proc/cpuinfo`` (what the kernels build for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_features().partition(":")[2].split())


def _cpuinfo_field(name: str) -> str | None:
    """The first processor's ``name`` field in ``/proc/cpuinfo``, or None."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The model name, with family/model/stepping: a VM may only say "AMD EPYC", and the
    numbers tell Milan (family 25 model 1) from Genoa (family 25 model 17)."""
    name = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    ids = [_cpuinfo_field(field) for field in ("cpu family", "model", "stepping")]
    if all(ids):
        name += f" (family {ids[0]} model {ids[1]} stepping {ids[2]})"
    return name


def cache_root() -> Path:
    """``$TESSERA_CACHE`` or ``~/.cache/tessera``: converted models under ``models/``, compiled
    kernels and their GEMM verdicts under ``kernels/``."""
    return Path(os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera")


def prebuilt_cache_root() -> Path:
    """``$TESSERA_PREBUILT_CACHE`` or /opt/tessera/cache: a read-only cache consulted first."""
    return Path(os.environ.get("TESSERA_PREBUILT_CACHE") or DEFAULT_PREBUILT_CACHE)


def model_cache_root() -> Path | None:
    """``$TESSERA_MODEL_CACHE``: a model cache shared by the pods of an InferenceCluster
    (spec.model.cache, a PersistentVolumeClaim), its conversions under ``models/``; None unset.
    Its fill step writes it, every rank reads it (read-only)."""
    value = os.environ.get("TESSERA_MODEL_CACHE")
    return Path(value) if value else None
