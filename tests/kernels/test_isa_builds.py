"""The native kernels compile for every x86 instruction-set level the project runs on.

A machine builds the kernels with ``-march=native`` and so compiles, and tests, only its own
variant of ``csrc/``: AVX-512 with AMX, with or without AVX512-BF16, AVX2, or neither (``panel_gemm.h``'s
``#if`` ladder). An edit made on one machine kind could break the build of another, whose
machines would then quietly run every layer through ATen. So each variant is compiled here (not
run: this CPU may lack the instructions) with the real build's flags, ``-march=native`` replaced.
A variant that compiled is recorded in the kernel cache, keyed on the sources, torch, the flags
and the compiler, so repeat runs cost nothing.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tessera import kernels

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the variants are x86's"),
]

# GCC 12 has no znver4/5: their AVX-512 is Ice Lake's plus AVX512-BF16.
ISA_VARIANTS = {
    # Xeons with AMX (Sapphire Rapids on): bf16 also through the AMX panels (amx_gemm.h)
    "amx": ["-march=sapphirerapids"],
    # EPYC Genoa and Turin: the 48-column panels, bf16 through vdpbf16ps
    "avx512-bf16": ["-march=icelake-server", "-mavx512bf16"],
    # Skylake-SP to Ice Lake: AVX-512 without bf16 dot products (bf16 weights use other backends)
    "avx512": ["-march=skylake-avx512"],
    # EPYC Rome and Milan, Haswell on: the 16-column AVX2 panels, bf16 widened in registers
    "avx2": ["-march=x86-64-v3"],
    # no AVX: no panels, and ATen's vector types for the rest
    "baseline": ["-march=x86-64-v2"],
}
NATIVE_FLAGS = ("-march=native", "-O3")


def compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch's builder runs


def compile_command(variant: list[str], output: Path) -> list[str]:
    """The real build's compile step for ``variant``, at -O0: a check, not a build (-O0 still
    inlines every intrinsic, which is where one the target lacks is refused)."""
    from torch.utils import cpp_extension

    assert set(NATIVE_FLAGS) <= set(kernels.CFLAGS), "the build's flags changed: update this check"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    return [
        compiler(),
        "-DTORCH_EXTENSION_NAME=tessera_isa_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-isystem{path}" for path in includes),
        "-fPIC",
        "-O0",
        *(flag for flag in kernels.CFLAGS if flag not in NATIVE_FLAGS),
        *variant,
        "-c",
        str(kernels.SOURCE),
        "-o",
        str(output),
    ]


def passed_marker(name: str, variant: list[str]) -> Path:
    """Keyed on contents, not paths: every checkout and venv of the same code shares it (CI
    clones afresh each run). The build key covers the sources, torch and the flags."""
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (kernels.build_key(), version, sysconfig.get_python_version(), *variant):
        digest.update(part.encode())
        digest.update(b"\0")
    return kernels._cache_root() / "isa-checks" / f"{name}-{digest.hexdigest()[:16]}"


def compile_errors(name: str, variant: list[str], scratch: Path) -> str | None:
    """None if ``variant`` compiles (now or in a recorded earlier run), else the compiler's errors."""
    marker = passed_marker(name, variant)
    if marker.exists():
        return None
    result = subprocess.run(compile_command(variant, scratch / f"{name}.o"), capture_output=True, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        return "\n".join(errors[:20] or result.stderr.splitlines()[-20:])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return None


def test_kernels_compile_for_every_isa_variant(tmp_path: Path) -> None:
    # Two at a time: each compiler takes a core and about a gigabyte.
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = dict(
            zip(
                ISA_VARIANTS,
                pool.map(lambda item: compile_errors(*item, tmp_path), ISA_VARIANTS.items()),
                strict=True,
            )
        )
    failed = {name: error for name, error in errors.items() if error is not None}
    assert not failed, "\n\n".join(
        f"{name} ({' '.join(ISA_VARIANTS[name])}):\n{error}" for name, error in failed.items()
    )
