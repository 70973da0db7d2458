"""`tessera bench serve` against the live server: exact output lengths, complete statistics, JSON + PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.serving.server import MODEL_NAME, ServerProcess


def test_bench_serve_random_workload_with_concurrency_cap(
    server: ServerProcess, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    args = [sys.executable, "-m", "tessera.cli", "bench", "serve", "--base-url", server.base_url]
    args += ["--model", MODEL_NAME, "--tokenizer", str(tiny_llama_dir), "--api-key", str(server.api_key)]
    args += ["--num-prompts", "12", "--random-input-len", "24", "--random-output-len", "10"]
    args += ["--random-range-ratio", "0.5", "--max-concurrency", "4", "--request-rate", "50"]
    args += ["--result-dir", str(tmp_path), "--result-name", "run"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Output token throughput" in done.stdout
    result = json.loads((tmp_path / "run.json").read_text())
    assert result["successful_requests"] == 12 and result["failed_requests"] == 0
    assert 1 <= result["peak_concurrency"] <= 4
    # ignore_eos: every request produced exactly the output length it asked for (5..15 tokens).
    outputs = [r["output_len"] for r in result["per_request"]]
    assert sum(outputs) == result["total_generated_tokens"] and all(5 <= n <= 15 for n in outputs)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["output_throughput"] > 0
    assert (tmp_path / "run.png").stat().st_size > 0
