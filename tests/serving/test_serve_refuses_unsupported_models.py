"""`tessera serve` on a model the engine cannot run stops at once with one line naming the
config.json field: exit code 2, no traceback, no engine core or rank process started."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

# case -> (config.json fields over the tiny Llama's, extra flags, the message)
CASES: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "unsupported rope type": (
        {"rope_parameters": {"rope_type": "foo", "rope_theta": 10000.0}},
        [],
        "config.json rope_parameters.rope_type 'foo' is not supported "
        "(default, linear, llama3, yarn, dynamic, longrope are)",
    ),
    "unknown architecture": (
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
        [],
        "config.json architectures ['GPT2LMHeadModel'] is not supported (supported: LlamaForCausalLM",
    ),
    # Refused from config.json alone, before any rank process would load a weight.
    "experts not divisible under expert parallelism": (
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 3},
        ["--tp", "2", "--enable-expert-parallel"],
        "config.json num_experts=3 is not divisible by tensor_parallel_size=2: --enable-expert-parallel",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_serve_names_the_field_and_exits(case: str, tiny_llama_dir: Path, tmp_path: Path) -> None:
    fields, flags, message = CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tessera.cli",
            "serve",
            str(folder),
            "--port",
            "0",
            "--num-threads",
            "1",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert message in output
    assert "Traceback" not in output
    assert "engine core" not in output  # refused before the engine core process (and its ranks) started
