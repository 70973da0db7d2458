"""`tessera generate`, the README's first shell command: the prompt and its greedy continuation,
as `LLM.generate` gives it; with --chat, the reply alone through the chat template."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tessera import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def generate_cli(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
    done = subprocess.run(
        [sys.executable, "-m", "tessera.cli", "generate", *args, "--num-threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_generate_prints_each_prompt_with_its_greedy_continuation(tiny_llama_dir: Path) -> None:
    prompts = ["Once upon a time", "The quick brown fox"]
    printed = generate_cli(str(tiny_llama_dir), *prompts, "--max-tokens", "6", "--max-model-len", "128")
    with LLM(str(tiny_llama_dir), max_model_len=128, num_threads=1) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=6)
        expected = [
            p + o.outputs[0].text for p, o in zip(prompts, llm.generate(prompts, greedy), strict=True)
        ]
        chat = llm.chat([{"role": "user", "content": "hi"}], greedy)[0].outputs[0].text
    assert printed == "".join(line + "\n" for line in expected)
    replied = generate_cli(str(tiny_llama_dir), "hi", "--chat", "--max-tokens", "6", "--max-model-len", "128")
    assert replied == chat + "\n"
