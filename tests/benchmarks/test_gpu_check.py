"""benchmarks/gpu_check.py's CPU smoke run: it runs end to end in a subprocess (no install, the
runtime imported from the checkout) and writes a JSON with every check's fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_run_on_cpu_writes_every_check(tmp_path: Path) -> None:
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TESSERA_BENCH_TAG")}
    completed = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        cwd=tmp_path,  # imports must not depend on the working folder
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check_cpu_smoke.json").read_text())
    assert (tmp_path / "gpu_check_cpu_smoke.png").stat().st_size > 0
    assert result["smoke"] is True
    assert {"name", "driver", "torch", "triton"} <= set(result["device"])
    attention = result["triton_attention"]
    assert attention["interpreted"] is True and attention["passed"] is True
    assert {case["dtype"] for case in attention["cases"]} == {"float32", "bfloat16", "float16"}
    (greedy,) = result["greedy"]
    assert greedy["dtype"] == "float32" and greedy["mismatches"] == [] and greedy["passed"] is True
    throughput = result["throughput"]
    assert throughput["batch_sizes"] == [1, 4]
    assert throughput["tessera"]["graphs"].startswith("not applicable")
    eager = throughput["tessera"]["eager"]
    assert len(eager["output_tok_s"]) == 2 and all(rate > 0 for rate in eager["output_tok_s"])
    assert eager["graph_replays"] is None  # eager: no graphs were captured
    assert len(throughput["transformers_output_tok_s"]) == 2
    assert throughput["copy_bandwidth_gb_s"] > 0
    assert all(fraction > 0 for fraction in throughput["fraction_of_bound"]["eager"])
