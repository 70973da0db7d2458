"""The x86 instruction-set levels the native kernels are written for, and which one a build targets.

A build is compiled for this CPU (``-march=native``) unless ``TESSERA_CPU_ISA`` names a variant:
then the kernels are those another CPU kind runs (``panel_gemm.h``'s ``#if`` ladder picks the
code by the compiler's ISA macros), provided this CPU has the instructions. Uses: a machine
testing the code paths of lesser CPU kinds (``tests/kernels/test_isa_variants.py``: a Xeon with
AMX runs Genoa's, Ice Lake's and Milan's kernels), and a node pool of mixed CPUs whose pods
should all run one variant.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

VARIABLE = "TESSERA_CPU_ISA"
NATIVE = "native"


@dataclass(frozen=True)
class IsaVariant:
    march: tuple[str, ...]  # replaces -march=native
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags a CPU needs to run what the compiler may emit
    runs_on: str


_V2 = frozenset({"sse4_2", "ssse3", "popcnt", "cx16"})
_V3 = _V2 | {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"}
_SKYLAKE_AVX512 = _V3 | {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
_ICELAKE = _SKYLAKE_AVX512 | {
    "avx512ifma",
    "avx512vbmi",
    "avx512_vbmi2",
    "avx512_vnni",
    "avx512_bitalg",
    "avx512_vpopcntdq",
    "gfni",
    "vaes",
    "vpclmulqdq",
}

# GCC 12 has no znver4/5: their AVX-512 is Ice Lake's plus AVX512-BF16.
ISA_VARIANTS: dict[str, IsaVariant] = {
    "amx": IsaVariant(
        ("-march=sapphirerapids",),
        _ICELAKE | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"},
        "Xeons with AMX (Sapphire Rapids on): bf16 also through the AMX panels (amx_gemm.h)",
    ),
    "avx512-bf16": IsaVariant(
        ("-march=icelake-server", "-mavx512bf16"),
        _ICELAKE | {"avx512_bf16"},
        "EPYC Genoa and Turin: the 48-column panels, bf16 through vdpbf16ps",
    ),
    "avx512": IsaVariant(
        ("-march=skylake-avx512",),
        _SKYLAKE_AVX512,
        "Skylake-SP to Ice Lake: AVX-512 without bf16 dot products (bf16 weights use other backends)",
    ),
    "avx2": IsaVariant(
        ("-march=x86-64-v3",),
        _V3,
        "EPYC Rome and Milan, Haswell on: the 16-column AVX2 panels, bf16 widened in registers",
    ),
    "baseline": IsaVariant(
        ("-march=x86-64-v2",), _V2, "no AVX: no panels, and ATen's vector types for the rest"
    ),
}


def runnable_variants(cpu_flags: set[str] | frozenset[str]) -> list[str]:
    """The variants a CPU with these /proc/cpuinfo flags can run."""
    return [name for name, variant in ISA_VARIANTS.items() if variant.cpu_flags <= cpu_flags]


def named_variant(value: str | None) -> str | None:
    """``value``, or None where it asks for this CPU's own build (unset, empty or native)."""
    return None if not value or value == NATIVE else value


def march_flags(requested: str | None, cpu_flags: set[str] | frozenset[str]) -> list[str]:
    """Compiler flags choosing the instruction set: ``-march=native`` unless ``requested`` names a
    variant, which must be one this CPU runs (code for instructions it lacks dies of SIGILL)."""
    name = named_variant(requested)
    if name is None:
        return ["-march=native"]
    variant = ISA_VARIANTS.get(name)
    if variant is None:
        raise ValueError(
            f"{VARIABLE}={name!r} is not a variant: use {NATIVE} or one of {', '.join(ISA_VARIANTS)}"
        )
    missing = sorted(variant.cpu_flags - cpu_flags)
    if missing:
        raise ValueError(
            f"{VARIABLE}={name}: this CPU lacks {', '.join(missing)}; it runs "
            f"{', '.join([NATIVE, *runnable_variants(cpu_flags)])}"
        )
    return list(variant.march)


def requested_variant() -> str | None:
    """The variant ``TESSERA_CPU_ISA`` names; None for this CPU's own build."""
    return named_variant(os.environ.get(VARIABLE))
