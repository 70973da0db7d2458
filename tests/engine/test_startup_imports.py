"""What each process imports before it can start work: transformers costs about 3.5 s of CPU.

A rank process (`tessera worker`) never needs it: it reads config.json itself. The HTTP server
needs it for the tokenizer only, which it loads on a thread while the engine core process
starts; imported with the server's modules, it would delay the engine core's start instead.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HEAVY = "{'transformers', 'aiohttp'}"


def imported_heavy_modules(statements: str) -> str:
    script = f"import sys\n{statements}\nprint(sorted({{m.split('.')[0] for m in sys.modules}} & {HEAVY}))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_a_rank_process_loads_its_model_without_transformers(tiny_llama_dir: Path) -> None:
    assert (
        imported_heavy_modules(
            "import torch, tessera.cli, tessera.worker.worker\n"
            "tessera.cli.build_parser()\n"
            "from tessera.models.loader import load_model\n"
            f"load_model({str(tiny_llama_dir)!r}, dtype=torch.float32, device='cpu')"
        )
        == "[]"
    )


def test_the_http_server_starts_its_engine_core_before_importing_transformers() -> None:
    assert imported_heavy_modules("import tessera.cli, tessera.entrypoints.api_server") == "[]"
