"""Native CPU kernels (``csrc/cpu_kernels.cpp``), compiled on first use and cached.

The build is keyed on the source, torch's version and this CPU's instruction sets (it is
compiled with ``-march=native``), under ``~/.cache/tessera/kernels/`` (``TESSERA_CACHE``
moves it), so a machine compiles once, in about a minute, and loads in milliseconds after.
Without a C++ compiler ``cpu_kernels()`` returns None, and with ``TESSERA_CPU_KERNELS=0`` it
is not used: the model then runs its ATen formulation, same results, slower.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-std=c++17"]


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_key() -> str:
    digest = hashlib.sha256()
    # Every file in csrc/: the header changes the build as much as the .cpp does.
    for part in (
        *(path.read_bytes() for path in sorted(CSRC.iterdir())),
        torch.__version__.encode(),
        " ".join(CFLAGS).encode(),
        _cpu_features().encode(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _cache_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")) / "kernels"


def _put_ninja_on_path() -> None:
    # torch's builder runs `ninja` from PATH; the wheel's binary serves when the venv is not active.
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


# Off with TESSERA_CPU_KERNELS=0; tests comparing the two paths flip this flag.
ENABLED = os.environ.get("TESSERA_CPU_KERNELS", "1") != "0"


def native_ops(device: torch.device) -> ModuleType | None:
    """The kernels to use for tensors on ``device``, or None for the ATen formulation."""
    if not ENABLED or device.type != "cpu":
        return None
    return cpu_kernels()


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None when they cannot be built here."""
    from torch.utils import cpp_extension

    key = build_key()
    build_dir = _cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    if not any(build_dir.glob("*.so")):
        logger.warning(
            "compiling Tessera's CPU kernels into %s (once per machine, about a minute)", build_dir
        )
    _put_ninja_on_path()
    try:
        return cpp_extension.load(
            name=f"tessera_cpu_kernels_{key}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, SystemExit) as error:
        logger.warning("Tessera's CPU kernels are unavailable, using ATen ops instead: %s", error)
        return None
