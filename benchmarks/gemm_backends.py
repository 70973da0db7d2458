"""Every GEMM backend Tessera can choose here, on the model's layer shapes, at decode and prefill row counts.

What ``tessera.kernels.gemm_selection`` decides from, shown whole: for each weight shape of one
decoder layer (QKV, attention output, gate_up, down; per dtype), the GFLOP/s of every candidate
backend at each row count, twice:

- cold: the packed weight evicted from the caches before each call, as a decode step meets it
  (each weight is read once per step, from memory);
- hot: the weight already cached, as a prefill chunk's row blocks meet it after the first.

gate_up is timed as the model runs it and the selection times it (``SwiGLUProduct``): each plain
product followed by the model's SwiGLU (``silu_and_mul``), or a gated kernel (SwiGLU in the GEMM's
epilogue) where the backend has one, shown beside that backend's plain product and SwiGLU pass;
GFLOP/s count the GEMM's multiply-adds alone. The backends take turns in each of ``--repeats`` rounds (each turn
an untimed call, then three timed ones; the best counts), so a burst of load from other processes
slows every candidate alike. The selection's verdict for each shape (recorded, or measured now
as a model load would) and the machine's matmul peak are written beside the timings. Compare
backends within one run: a shared machine's hours differ by 10-20%.

Run: ``.venv/bin/python benchmarks/gemm_backends.py [--dtypes float32,bfloat16] [--rows 8,64,512,2048]``.
Writes ``benchmarks/results/gemm_backends_<machine kind>.json`` and ``.png`` (``common.result_path``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from common import (
    environment_info,
    hold_to_cpu_isa,
    measure_matmul_peak,
    new_figure,
    save_figure,
    set_threads,
    write_json,
)
from offline_throughput import MODEL, layer_shapes

from tessera.kernels import gemm, gemm_selection
from tessera.models.layers.activation import silu_and_mul

NAME = "gemm_backends"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def candidate_forms(name: str, weight: torch.Tensor) -> dict[str, gemm.PackedWeight]:
    """Each candidate backend's form of ``weight`` as the selection times it; for gate_up, the
    gated kernels' backends also unfused, to show what their epilogue saves."""
    if name != "gate_up":
        return {backend.name: backend.pack(weight) for backend in gemm.candidates(weight)}
    forms: dict[str, gemm.PackedWeight] = {}
    for backend in gemm.candidates(weight):
        product = gemm.SwiGLUProduct(backend.name, weight, silu_and_mul)
        forms[f"gated {backend.name}" if product.gated is not None else backend.name] = product
        if product.gated is not None:
            forms[backend.name] = gemm.SwiGLUProduct(backend.name, weight, silu_and_mul, fused=False)
    return forms


# Timed calls of one form in a row, within each round.
CALLS_PER_TURN = 3


def best_seconds(
    forms: dict[str, gemm.PackedWeight], x: torch.Tensor, cold: bool, repeats: int
) -> dict[str, float]:
    """Best time of each form on ``x`` over ``repeats`` rounds, the forms taking turns in each.
    A turn starts with an untimed call, and times several: a call right after another form's
    finds the caches and the allocator as that form left them. On the Xeon with AMX, timed one
    call a turn, the gated AMX kernel on gate_up at 2048 rows read 1950-2100 GFLOP/s, against
    2450-2700 in turns of three or alone."""
    best = dict.fromkeys(forms, float("inf"))
    for _ in range(repeats):
        for name, form in forms.items():
            form.matmul(x, None)
            for _ in range(CALLS_PER_TURN):
                if cold:
                    gemm_selection.evict(form)
                started = time.perf_counter()
                form.matmul(x, None)
                best[name] = min(best[name], time.perf_counter() - started)
    return best


def measure_shape(
    name: str, shape: tuple[int, int], dtype: torch.dtype, rows: list[int], repeats: int
) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
    forms = candidate_forms(name, weight)
    # Recorded, or measured now as a model load would (gate_up: as SiluGatedLinear selects it).
    verdict = gemm_selection.selected_backend(weight, swiglu=silu_and_mul if name == "gate_up" else None)
    gflops: dict[str, dict[str, dict[str, float]]] = {"cold": {}, "hot": {}}
    with torch.inference_mode():
        for count in rows:
            x = torch.randn(count, shape[1], generator=generator).to(dtype)
            flops = 2.0 * count * shape[0] * shape[1]
            for regime in gflops:
                seconds = best_seconds(forms, x, regime == "cold", repeats)
                gflops[regime][str(count)] = {form: round(flops / s / 1e9, 1) for form, s in seconds.items()}
    return {
        "shape": list(shape),
        "verdict": verdict,
        "packed_bytes": {form: gemm_selection.packed_bytes(packed) for form, packed in forms.items()},
        "gflops": gflops,
    }


def plot(results: dict[str, dict[str, Any]], peaks: dict[str, float], rows: list[int]) -> Any:
    dtypes = list(results)
    shapes = list(next(iter(results.values())))
    fig, grid = new_figure(ncols=len(shapes), width=4.2, height=3.6, nrows=len(dtypes))
    for row_index, dtype in enumerate(dtypes):
        for col_index, shape_name in enumerate(shapes):
            ax = grid[row_index][col_index]
            entry = results[dtype][shape_name]
            forms = list(entry["gflops"]["hot"][str(rows[0])])
            for form_index, form in enumerate(forms):
                color = f"C{form_index}"
                for regime, style in (("hot", "-"), ("cold", "--")):
                    values = [entry["gflops"][regime][str(count)][form] for count in rows]
                    label = form if regime == "hot" else None
                    ax.plot(rows, values, style, color=color, marker="o", markersize=3, label=label)
            ax.axhline(peaks[dtype] / 1e9, color="grey", linewidth=0.8, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(rows, [str(count) for count in rows])
            out_features, in_features = entry["shape"]
            verdict = entry["verdict"]
            ax.set_title(f"{dtype} {shape_name} {out_features}x{in_features}\nverdict: {verdict}", fontsize=9)
            ax.set_xlabel("rows of x")
            if col_index == 0:
                ax.set_ylabel("GFLOP/s (solid: hot, dashed: cold)")
            ax.legend(fontsize=7)
    fig.suptitle("GEMM backends on the model's layer shapes (dotted: the machine's matmul peak)", fontsize=10)
    fig.tight_layout()
    return save_figure(NAME, fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="8,64,512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    threads = set_threads(args.threads)
    hold_to_cpu_isa()  # TESSERA_CPU_ISA: another kind's instructions, before the first GEMM
    rows = [int(count) for count in args.rows.split(",")]
    dtypes = [DTYPES[name] for name in args.dtypes.split(",")]

    from transformers import AutoConfig

    from tessera.models.registry import resolve_model

    shapes = layer_shapes(AutoConfig.from_pretrained(resolve_model(MODEL)))
    peaks, results = {}, {}
    for dtype in dtypes:
        dtype_name = str(dtype).removeprefix("torch.")
        peaks[dtype_name] = measure_matmul_peak(dtype)["peak_flops"]
        results[dtype_name] = {}
        for name, shape in shapes.items():
            results[dtype_name][name] = entry = measure_shape(name, shape, dtype, rows, args.repeats)
            for regime in ("cold", "hot"):
                cells = "; ".join(
                    f"{count}: " + ", ".join(f"{form} {value:.0f}" for form, value in by_form.items())
                    for count, by_form in entry["gflops"][regime].items()
                )
                print(f"{dtype_name} {name} {shape[0]}x{shape[1]} {regime} GFLOP/s | {cells}")
    data = {
        "benchmark": NAME,
        "model": MODEL,
        "threads": threads,
        "rows": rows,
        "repeats": args.repeats,
        "matmul_peak_flops": peaks,
        "results": results,
        "environment": environment_info(),
    }
    print(f"wrote {write_json(NAME, data)} and {plot(results, peaks, rows)}")


if __name__ == "__main__":
    main()
