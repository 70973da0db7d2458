"""One live `tessera serve` (tiny random-weight Llama) shared by the serving tests of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.server import ServerProcess

ALLOWED_ORIGIN = "https://chat.example.com"  # a web app whose pages may call the shared server


@pytest.fixture(scope="session")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--max-model-len", "128", "--max-num-seqs", "64", "--allowed-origins", ALLOWED_ORIGIN)
    proc = ServerProcess(tiny_llama_dir, *args, log=log)
    yield proc
    proc.stop()
