"""The real SmolLM2 through `tessera serve`: greedy output equals the offline LLM's, text and chat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.serving.server import MODEL_NAME, ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2_server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    proc = ServerProcess(smollm2_dir, "--dtype", "float32", api_key=None, log=log)
    yield proc
    proc.stop()


def test_greedy_served_equals_offline(smollm2_server: ServerProcess, smollm2_dir: Path) -> None:
    from tessera.entrypoints.llm import LLM
    from tessera.sampling_params import SamplingParams

    client = openai.OpenAI(
        base_url=f"{smollm2_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    served = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0.0).choices[0].text
        for p in PROMPTS
    ]
    served_chat = (
        client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=24, temperature=0.0)
        .choices[0]
        .message.content
    )
    params = SamplingParams(temperature=0.0, max_tokens=24)
    llm = LLM(str(smollm2_dir), dtype="float32", num_threads=1)
    try:
        offline = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
        offline_chat = llm.chat(QUESTION, params)[0].outputs[0].text
    finally:
        llm.engine.shutdown()
    assert served == offline
    assert served_chat == offline_chat
    assert "Paris" in served_chat
