"""A kernel build killed midway leaves torch's `lock` baton behind; the next start must take it over
instead of waiting forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tessera import kernels
from tessera.kernels import build

# Takes the build lock, plants torch's baton as a builder would, then dies without cleaning up.
KILLED_BUILDER = """
import os, signal, sys
from pathlib import Path
from tessera.kernels.build import TORCH_BATON, build_lock

build_dir = Path(sys.argv[1])
with build_lock(build_dir):
    (build_dir / TORCH_BATON).touch()
    os.kill(os.getpid(), signal.SIGKILL)
"""

LOAD_KERNELS = "from tessera.kernels import cpu_kernels; assert cpu_kernels() is not None"


def test_baton_of_a_killed_builder_is_taken_over(tmp_path: Path) -> None:
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BUILDER, str(tmp_path)], capture_output=True, timeout=60
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert (tmp_path / build.TORCH_BATON).exists()
    with build.build_lock(tmp_path):  # the kernel released the dead builder's lock
        assert not (tmp_path / build.TORCH_BATON).exists()


@pytest.mark.skipif(not kernels.ENABLED, reason="CPU kernels disabled")
def test_kernels_load_despite_a_stale_baton_in_the_real_build_folder() -> None:
    # Built once per machine (other tests need it too); then loading takes seconds.
    subprocess.run([sys.executable, "-c", LOAD_KERNELS], check=True, timeout=900)
    build_dir = build.cache_root() / kernels.build_key()
    with build.build_lock(build_dir):  # no live builder while the baton is planted
        (build_dir / build.TORCH_BATON).touch()
    # torch's FileBaton used to wait for this file forever.
    subprocess.run([sys.executable, "-c", LOAD_KERNELS], check=True, timeout=120)
    # Checked under the build lock: another process loading the kernels meanwhile holds a baton
    # of its own for a moment, legitimately.
    with build.build_lock(build_dir):
        assert not (build_dir / build.TORCH_BATON).exists()


@pytest.mark.skipif(not kernels.ENABLED, reason="CPU kernels disabled")
def test_a_build_from_another_venv_is_loaded_not_recompiled() -> None:
    subprocess.run([sys.executable, "-c", LOAD_KERNELS], check=True, timeout=900)
    build_dir = build.cache_root() / kernels.build_key()
    built = next(build_dir.glob("*.so"))
    with build.build_lock(build_dir):
        # What another checkout's venv leaves: the same key, built by a command that named
        # torch's headers at another path (ninja's log keeps each output's command hash).
        log = build_dir / ".ninja_log"
        header, *entries = log.read_text().splitlines()
        other = ["\t".join([*entry.split("\t")[:4], "0" * 16]) for entry in entries]
        log.write_text("\n".join([header, *other]) + "\n")
        stamp = built.stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", LOAD_KERNELS], check=True, timeout=120)
    assert built.stat().st_mtime_ns == stamp


def test_a_build_that_does_not_load_is_compiled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "load_prebuilt", lambda key: None)
    build_dir = build.cache_root() / kernels.build_key()
    build_dir.mkdir(parents=True)
    (build_dir / f"tessera_cpu_kernels_{kernels.build_key()}.so").write_bytes(b"cut short by a killed link")
    rebuilt = object()
    monkeypatch.setattr(cpp_extension, "load", lambda **options: rebuilt)
    assert kernels.cpu_kernels.__wrapped__() is rebuilt


@pytest.mark.parametrize("compiler", ["missing", "broken"])
def test_a_compiler_that_cannot_build_leaves_the_model_on_aten(tmp_path: Path, compiler: str) -> None:
    """No compiler, or one that fails even to tell its version (a wrapper whose toolchain was
    removed): the kernels are None and the model runs on ATen, never a failed start."""
    broken = tmp_path / "bin" / "c++"
    broken.parent.mkdir()
    broken.write_text("#!/bin/sh\nexit 127\n")
    broken.chmod(0o755)
    env = {
        **os.environ,
        "TESSERA_CACHE": str(tmp_path / "cache"),  # nothing built before
        "TESSERA_PREBUILT_CACHE": str(tmp_path / "no-image-cache"),
        "CXX": str(tmp_path / "nowhere" / "c++") if compiler == "missing" else str(broken),
    }
    script = (
        "import torch; from tessera.kernels import cpu_kernels; from tessera.models.layers.norm import RMSNorm\n"
        "assert cpu_kernels() is None\n"
        "print(RMSNorm(8)(torch.ones(2, 8))[0].shape)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "using ATen ops instead" in done.stderr and "torch.Size([2, 8])" in done.stdout
