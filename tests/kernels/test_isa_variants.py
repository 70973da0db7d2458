"""The native kernels build, and compute correctly, for every x86 instruction-set level the
project runs on (``tessera/kernels/isa.py``).

A machine builds the kernels with ``-march=native`` and so exercises only its own variant of
``csrc/`` (``panel_gemm.h``'s ``#if`` ladder). An edit made on one machine kind could break another
kind's kernels, whose machines would then quietly run every layer through ATen, or compute wrong.
So each variant below this CPU's own is built for real (``TESSERA_CPU_ISA``) and the kernel tests
run on it; each variant this CPU lacks is compiled (not run) with the real build's flags. A Xeon
with AMX runs the kernels of Genoa, Ice Lake and Milan; a Milan compiles the AVX-512 ones.
Compile checks that passed are recorded in the kernel cache, keyed on the sources, torch, the
flags and the compiler, so repeat runs cost nothing; variant builds are cached like any build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tessera import host, kernels
from tessera.kernels import build, isa

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the variants are x86's")

REPO = Path(__file__).resolve().parents[2]
# The tests that compare every kernel with ATen / F.linear, and the decoder stack with the layer loop.
KERNEL_TESTS = (
    "tests/kernels/test_cpu_kernels.py",
    "tests/kernels/test_gemm_selection.py",
    "tests/models/test_decoder_stack.py",
)
RUNNABLE = isa.runnable_variants(host.cpu_flags())
# The most capable variant this CPU runs is what -march=native builds (the suite runs it).
LESSER_VARIANTS = RUNNABLE[1:]
MISSING_VARIANTS = [name for name in isa.ISA_VARIANTS if name not in RUNNABLE]


def compiler() -> str:
    return os.environ.get("CXX", "c++")  # what torch's builder runs


def compile_command(variant: str, output: Path) -> list[str]:
    """The real build's compile step for ``variant``, at -O0: a check, not a build (-O0 still
    inlines every intrinsic, which is where one the target lacks is refused)."""
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    flags = build.compile_flags(list(isa.ISA_VARIANTS[variant].march))
    return [
        compiler(),
        "-DTORCH_EXTENSION_NAME=tessera_isa_check",
        "-DTORCH_API_INCLUDE_EXTENSION_H",
        *(f"-isystem{path}" for path in includes),
        "-fPIC",
        *flags,
        "-O0",  # after the build's -O3: the last -O wins
        "-c",
        str(build.SOURCE),
        "-o",
        str(output),
    ]


def passed_marker(variant: str) -> Path:
    """Keyed on contents, not paths: every checkout and venv of the same code shares it (CI
    clones afresh each run). The build key covers the sources, torch and the flags."""
    version = subprocess.run([compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for part in (
        kernels.build_key(),
        version,
        sysconfig.get_python_version(),
        *isa.ISA_VARIANTS[variant].march,
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return build.cache_root() / "isa-checks" / f"{variant}-{digest.hexdigest()[:16]}"


def compile_errors(variant: str, scratch: Path) -> str | None:
    """None if ``variant`` compiles (now or in a recorded earlier run), else the compiler's errors."""
    marker = passed_marker(variant)
    if marker.exists():
        return None
    result = subprocess.run(
        compile_command(variant, scratch / f"{variant}.o"), capture_output=True, text=True
    )
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        return "\n".join(errors[:20] or result.stderr.splitlines()[-20:])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return None


def variant_environment(variant: str) -> dict[str, str]:
    return {**os.environ, isa.VARIABLE: variant}


def build_variant(variant: str) -> subprocess.CompletedProcess[str]:
    script = "from tessera.kernels import cpu_kernels; import sys; sys.exit(cpu_kernels() is None)"
    return subprocess.run(
        [sys.executable, "-c", script],
        env=variant_environment(variant),
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_build_is_native_unless_a_variant_is_named() -> None:
    avx2_cpu = isa.ISA_VARIANTS["avx2"].cpu_flags
    assert isa.march_flags(None, avx2_cpu) == isa.march_flags("native", avx2_cpu) == ["-march=native"]
    assert isa.march_flags("avx2", avx2_cpu) == ["-march=x86-64-v3"]
    assert isa.runnable_variants(avx2_cpu) == ["avx2", "baseline"]
    assert isa.runnable_variants(isa.ISA_VARIANTS["amx"].cpu_flags) == list(isa.ISA_VARIANTS)


def test_an_unknown_variant_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"TESSERA_CPU_ISA='avx9' is not a variant: use native or one of amx, "
    ):
        isa.march_flags("avx9", frozenset())


def test_a_variant_this_cpu_lacks_is_refused_naming_what_it_lacks() -> None:
    milan = isa.ISA_VARIANTS["avx2"].cpu_flags | {"sha_ni"}
    with pytest.raises(
        ValueError,
        match=r"TESSERA_CPU_ISA=avx512: this CPU lacks avx512bw, .*; it runs native, avx2, baseline",
    ):
        isa.march_flags("avx512", milan)


def test_a_refused_variant_stops_the_process_before_anything_is_built() -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import tessera.kernels"],
        env=variant_environment("avx9"),
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "TESSERA_CPU_ISA='avx9' is not a variant" in result.stderr


@pytest.mark.slow
def test_every_variant_this_cpu_lacks_compiles(tmp_path: Path) -> None:
    if not MISSING_VARIANTS:
        pytest.skip(f"this CPU runs every variant ({', '.join(RUNNABLE)}): the test below runs them")
    # Two at a time: each compiler takes a core and about a gigabyte.
    with ThreadPoolExecutor(max_workers=2) as pool:
        errors = dict(
            zip(
                MISSING_VARIANTS,
                pool.map(lambda name: compile_errors(name, tmp_path), MISSING_VARIANTS),
                strict=True,
            )
        )
    failed = {name: error for name, error in errors.items() if error is not None}
    assert not failed, "\n\n".join(
        f"{name} ({' '.join(isa.ISA_VARIANTS[name].march)}):\n{error}" for name, error in failed.items()
    )


@pytest.mark.slow
def test_the_kernel_tests_pass_on_every_lesser_variant_this_cpu_runs() -> None:
    if not LESSER_VARIANTS:
        pytest.skip(f"this CPU runs no variant below its own ({', '.join(RUNNABLE) or 'none'})")
    # Built two at a time first (a minute each, once per source change); the tests then run one
    # variant at a time, since each uses every core.
    with ThreadPoolExecutor(max_workers=2) as pool:
        builds = dict(zip(LESSER_VARIANTS, pool.map(build_variant, LESSER_VARIANTS), strict=True))
    unbuilt = {name: result.stderr[-3000:] for name, result in builds.items() if result.returncode != 0}
    assert not unbuilt, "\n\n".join(f"{name} did not build:\n{error}" for name, error in unbuilt.items())
    failures = {}
    for variant in LESSER_VARIANTS:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *KERNEL_TESTS],
            cwd=REPO,
            env=variant_environment(variant),
            capture_output=True,
            text=True,
            timeout=900,
        )
        if result.returncode != 0:
            failures[variant] = result.stdout[-4000:] + result.stderr[-2000:]
    assert not failures, "\n\n".join(f"{isa.VARIABLE}={name}:\n{output}" for name, output in failures.items())
