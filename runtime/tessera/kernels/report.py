"""What ``tessera kernels`` shows: this machine's CPU kernel build, and the GEMM backend chosen per weight shape.

What to ask a node whose throughput surprises: which instruction set the kernels are built
for, whether the build is there, and which backend won each weight shape and by how much (the
verdicts ``gemm_selection`` recorded). ``--forget`` deletes this cache's verdicts so that the
next model load measures again: after a verdict was taken in a bad hour, or a cache was copied
from another machine. The read-only prebuilt cache (an image's) is listed, never changed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from tessera import host, kernels
from tessera.kernels import build, gemm, gemm_selection, isa

DTYPES = (torch.float32, torch.bfloat16)


def _candidates_now(dtype: str, in_features: int) -> list[str]:
    """The backends this build and environment offer for such a weight (the out width does not
    matter to any of them)."""
    return [
        backend.name for backend in gemm.candidates(torch.empty(1, in_features, dtype=getattr(torch, dtype)))
    ]


def _verdicts(built: bool) -> list[dict[str, Any]]:
    """Every recorded verdict, this cache's over the prebuilt cache's for the same key; where the
    kernels are ``built``, whether each was measured among the backends they offer now (a process
    with ``TESSERA_CPU_KERNELS=0`` offers fewer, and records and reads verdicts of its own)."""
    sources = gemm_selection.recorded_selections_by_source()  # this cache's last: they win
    merged = {key: (source, entry) for source, data in sources.items() for key, entry in data.items()}
    verdicts = []
    for key, (source, entry) in merged.items():
        try:
            fields = gemm_selection.parse_selection_key(key)
        except ValueError:
            continue  # another version's key: never read by this one
        verdicts.append(
            {
                "dtype": fields.dtype,
                "out_features": fields.out_features,
                "in_features": fields.in_features,
                "layer": "swiglu" if fields.swiglu else "linear",
                "threads": fields.threads,
                "rows": list(fields.rows),
                "backend": entry.get("backend"),
                "scores": entry.get("scores", {}),
                "packed_bytes": entry.get("packed_bytes", {}),
                "source": source,
                "key": key,
                "all_candidates": (
                    list(fields.candidates) == _candidates_now(fields.dtype, fields.in_features)
                    if built
                    else None
                ),
            }
        )
    return sorted(
        verdicts,
        key=lambda v: (v["dtype"], v["threads"], v["out_features"], v["in_features"], v["layer"], v["rows"]),
    )


def kernel_report() -> dict[str, Any]:
    """The build and the verdicts, without building or measuring anything."""
    state, extension = kernels.build_state()
    variant = isa.requested_variant()
    report: dict[str, Any] = {
        "cpu_model": host.cpu_model(),
        "process_cpus": len(host.PROCESS_CPUS),
        "isa_variant": variant or isa.NATIVE,
        "isa_variants_runnable": isa.runnable_variants(host.cpu_flags()),
        "compile_flags": build.CFLAGS,
        "build_key": kernels.build_key(),
        "build": state,
        "extension": str(extension),
        "forced_backend": os.environ.get(gemm_selection.FORCE_VARIABLE) or None,
        "selection_file": str(gemm_selection.selection_path()),
        "prebuilt_selection_file": str(gemm_selection.prebuilt_selection_path()),
        "verdicts": _verdicts(built=state != "not built"),
    }
    # Which backends exist depends on the build; listing them must not start a minute's compile.
    report["backends"] = (
        None
        if state == "not built"
        else {
            str(dtype).removeprefix("torch."): [
                b.name for b in gemm.candidates(torch.empty(64, 64, dtype=dtype))
            ]
            for dtype in DTYPES
        }
    )
    return report


def _scores(scores: dict[str, float]) -> str:
    return ", ".join(
        f"{name} {score:.3f}" for name, score in sorted(scores.items(), key=lambda item: item[1])
    )


def format_report(report: dict[str, Any]) -> str:
    backends = report["backends"]
    lines = [
        f"CPU            {report['cpu_model']}, {report['process_cpus']} CPUs for this process",
        f"instructions   {report['isa_variant']} ({' '.join(report['compile_flags'])}); "
        f"{isa.VARIABLE} may name {', '.join([isa.NATIVE, *report['isa_variants_runnable']])}",
        f"kernel build   {report['build']}: {report['extension']}",
        "GEMM backends  "
        + (
            "known once the kernels are built (the first model load builds them, about a minute)"
            if backends is None
            else "; ".join(f"{dtype}: {', '.join(names)}" for dtype, names in backends.items())
        ),
    ]
    if report["forced_backend"]:
        lines.append(f"forced         {gemm_selection.FORCE_VARIABLE}={report['forced_backend']}")
    verdicts = report["verdicts"]
    if not verdicts:
        lines.append(
            f"GEMM verdicts  none yet: a model load measures and records them in {report['selection_file']}"
        )
        return "\n".join(lines)
    prebuilt = sum(v["source"] == "prebuilt" for v in verdicts)
    lines.append(
        f"GEMM verdicts  {len(verdicts) - prebuilt} in {report['selection_file']}"
        + (f", {prebuilt} in {report['prebuilt_selection_file']}" if prebuilt else "")
    )
    header = (
        "dtype",
        "weight",
        "layer",
        "threads",
        "rows",
        "backend",
        "scores (1.0: fastest at every row count)",
    )
    rows = [
        (
            v["dtype"],
            f"{v['out_features']}x{v['in_features']}",
            v["layer"],
            str(v["threads"]),
            ",".join(map(str, v["rows"])),
            str(v["backend"])
            + (" (prebuilt)" if v["source"] == "prebuilt" else "")
            + (" *" if v["all_candidates"] is False else ""),
            _scores(v["scores"]),
        )
        for v in verdicts
    ]
    table = [header, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines += [
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]
    if any(v["all_candidates"] is False for v in verdicts):
        lines.append(
            "  * measured among fewer backends than this build offers (e.g. with TESSERA_CPU_KERNELS=0)"
        )
    return "\n".join(lines)


def run(json_output: bool = False, forget: bool = False) -> int:
    """``tessera kernels [--json] [--forget]``."""
    if forget:
        count = gemm_selection.forget_recorded()
        print(
            f"deleted {count} GEMM verdicts from {gemm_selection.selection_path()}: the next model load measures again"
        )
        return 0
    report = kernel_report()
    print(json.dumps(report, indent=1) if json_output else format_report(report))
    return 0
