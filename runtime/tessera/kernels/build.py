"""Building and loading the native CPU kernels (``csrc/``, one extension module from ``bindings.cpp``).

The build is keyed on the sources, torch's version, this CPU's instruction sets and the flags
(``-march=native``, or the variant ``TESSERA_CPU_ISA`` names: ``isa.py``), under
``~/.cache/tessera/kernels/`` (``TESSERA_CACHE`` moves it), so a machine compiles once, in
about a minute, and loads in milliseconds after. Without a C++ compiler ``cpu_kernels()``
returns None. A build found under the read-only prebuilt cache (``TESSERA_PREBUILT_CACHE``,
where an image bakes it in) is loaded as is, without locking or compiling.

The cache survives a process killed at any point: builds and loads of one build folder take
an fcntl lock (released by the kernel when its holder dies), so torch's own ``lock`` file
found there while holding it was left by a dead builder and is removed instead of waited on
forever. Sources are compiled from a copy inside the build folder, so checkouts at different
paths share one build instead of rebuilding over each other.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from tessera import host
from tessera.kernels import isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# The one translation unit: it includes every header of csrc/.
SOURCE = CSRC / "bindings.cpp"
# torch.utils.cpp_extension's FileBaton: created by the builder, removed when it finishes.
TORCH_BATON = "lock"
BUILD_LOCK = ".tessera-build.lock"
# Bumped when the layout of a build folder changes, so old and new code never share one.
LAYOUT = b"staged-sources-1"


def compile_flags(march: list[str]) -> list[str]:
    return ["-O3", *march, "-mprefer-vector-width=512", "-fopenmp", "-std=c++17"]


# A TESSERA_CPU_ISA this CPU cannot run is refused here, before anything is built.
CFLAGS = compile_flags(isa.march_flags(isa.requested_variant(), host.cpu_flags()))


def sources() -> list[Path]:
    """Every file in csrc/: a header changes the build as much as the .cpp does."""
    return sorted(CSRC.iterdir())


@functools.cache  # read for every weight's GEMM verdict
def build_key() -> str:
    digest = hashlib.sha256()
    for part in (
        *(path.read_bytes() for path in sources()),
        torch.__version__.encode(),
        " ".join(CFLAGS).encode(),
        host.cpu_features().encode(),
        LAYOUT,
    ):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    return host.cache_root() / "kernels"


def _module_name(key: str) -> str:
    return f"tessera_cpu_kernels_{key}"


def _prebuilt_extension(key: str) -> Path:
    return host.prebuilt_cache_root() / "kernels" / key / f"{_module_name(key)}.so"


def _own_extension(key: str) -> Path:
    return cache_root() / key / f"{_module_name(key)}.so"


def load_prebuilt(key: str) -> ModuleType | None:
    """The extension module an image compiled for this exact key, if there is one."""
    path = _prebuilt_extension(key)
    return _load_extension(path) if path.is_file() else None


def artifact_state() -> tuple[str, Path]:
    """Whether this build is ``prebuilt``, ``built`` or ``not built`` (without building it), and
    where its extension module is, or will be once a model loads."""
    key = build_key()
    prebuilt, own = _prebuilt_extension(key), _own_extension(key)
    if prebuilt.is_file():
        return "prebuilt", prebuilt
    return ("built" if own.is_file() else "not built"), own


def _load_extension(path: Path) -> ModuleType:
    """Import a compiled extension module from ``path`` (its file name is the module's name)."""
    name = path.name.removesuffix(".so")
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _put_ninja_on_path() -> None:
    # torch's builder runs `ninja` from PATH; the wheel's binary serves when the venv is not active.
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Exclusive use of ``build_dir``; a torch baton found inside belongs to a dead process."""
    with open(build_dir / BUILD_LOCK, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            baton = build_dir / TORCH_BATON
            if baton.exists():
                logger.warning("removing %s, left by a kernel build that was killed", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _stage_sources(build_dir: Path) -> Path:
    """Copy csrc/ into the build folder (atomically, only what differs) and return the .cpp to build."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for path in sources():
        target = staged / path.name
        content = path.read_bytes()
        if target.is_file() and target.read_bytes() == content:
            continue  # rewriting would touch its mtime and make ninja rebuild
        with tempfile.NamedTemporaryFile(dir=staged, delete=False, prefix=f".{path.name}.") as tmp:
            tmp.write(content)
        os.replace(tmp.name, target)
    return staged / SOURCE.name


def _load_or_build(key: str, build_dir: Path) -> ModuleType:
    """The module of ``build_dir``, compiled first unless a complete one is there (under its lock)."""
    with build_lock(build_dir):
        built = build_dir / f"{_module_name(key)}.so"
        if built.is_file():
            # The key pins sources, flags, torch and CPU; only torch's include path in ninja's
            # command differs between venvs, and rebuilding for it cost a minute per checkout.
            try:
                return _load_extension(built)
            except ImportError as error:  # a link killed half-way: build it again
                logger.warning("rebuilding Tessera's CPU kernels, %s did not load: %s", built, error)
        source = _stage_sources(build_dir)
        if not built.is_file():
            logger.warning(
                "compiling Tessera's CPU kernels into %s (once per machine, about a minute)", build_dir
            )
        # Only a build needs torch's builder: importing it (and setuptools) costs 0.2 s of CPU.
        from torch.utils import cpp_extension

        return cpp_extension.load(
            name=_module_name(key),
            sources=[str(source)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, or None when they cannot be built here."""
    key = build_key()
    prebuilt = load_prebuilt(key)
    if prebuilt is not None:
        return prebuilt
    build_dir = cache_root() / key
    _put_ninja_on_path()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return _load_or_build(key, build_dir)
    # SubprocessError: a compiler that fails even to tell its version (torch's builder asks first).
    except (OSError, RuntimeError, ImportError, SystemExit, subprocess.SubprocessError) as error:
        logger.warning("Tessera's CPU kernels are unavailable, using ATen ops instead: %s", error)
        return None
