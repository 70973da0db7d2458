"""A request the engine core cannot serve fails alone, against a live engine core process running a
tiny model: its caller gets FINISH_ERROR with a reason, its KV blocks are freed, and every other
request completes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.config import EngineConfig
from tessera.core.request import Request, RequestRejected, RequestStatus
from tessera.engine.core import EngineCore
from tessera.engine.core_client import SyncMPClient
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import FINISH_ERROR, EngineCoreOutput, EngineCoreRequest
from tessera.worker.sampler import SamplingMetadata

VICTIM = "victim"


class FaultyStopEngineCore(EngineCore):
    """Raises inside the stop handling of the request named VICTIM: a bug that hits one request."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        check_stop = self.scheduler._check_stop

        def faulty(request: Request, token_id: int) -> RequestStatus | None:
            if request.request_id == VICTIM:
                raise RuntimeError("injected fault in stop handling")
            return check_stop(request, token_id)

        self.scheduler._check_stop = faulty  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> Iterator[SyncMPClient]:
    config = EngineConfig(
        model=str(tiny_llama_dir),
        block_size=16,
        num_kv_blocks=80,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
        num_threads=1,
    )
    client = SyncMPClient(config, FaultyStopEngineCore)
    yield client
    client.shutdown()


def engine_request(
    request_id: str, prompt: list[int], max_tokens: int = 6, **params: object
) -> EngineCoreRequest:
    params = {"temperature": 0.0, **params}
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)  # type: ignore[arg-type]
    return EngineCoreRequest(request_id, prompt, sampling, eos_token_id=None, arrival_time=time.time())


def run(client: SyncMPClient, requests: list[EngineCoreRequest]) -> dict[str, list[EngineCoreOutput]]:
    """Submit, then gather every output until each request id has finished (errors included)."""
    outputs: dict[str, list[EngineCoreOutput]] = {r.request_id: [] for r in requests}
    for req in requests:
        client.add_request(req)
    finished: set[str] = set()
    while finished != set(outputs):
        for out in client.get_output(timeout=60).outputs:
            outputs[out.request_id].append(out)
            if out.finished:
                finished.add(out.request_id)
    return outputs


def tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [token for out in outputs for token in out.new_token_ids]


def wait_until_idle(client: SyncMPClient) -> float:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = client.get_output(timeout=30).scheduler_stats
        if stats is not None and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
            return stats.kv_cache_usage
    raise AssertionError("the engine core never went idle")


def test_failing_requests_fail_alone_and_free_their_blocks(client: SyncMPClient) -> None:
    prompt = [5, 6, 7, 8, 9]
    outputs = run(
        client,
        [
            engine_request("ok", prompt),
            engine_request(VICTIM, prompt),
            # Used to index the logits with the huge id and kill the engine core.
            engine_request("huge-stop-id", prompt, min_tokens=1, stop_token_ids=[2_147_483_647]),
            engine_request("out-of-vocab", [5, 100_000, 7]),
            engine_request("wider-than-a-step", list(range(1, 101))),  # chunked prefill is off
            engine_request("longer-than-context", [1] * 2000),
        ],
    )
    errors = {rid: outs[-1].error for rid, outs in outputs.items() if outs[-1].finish_reason == FINISH_ERROR}
    assert set(errors) == {VICTIM, "out-of-vocab", "wider-than-a-step", "longer-than-context"}
    assert errors[VICTIM] == "internal error (RuntimeError)"
    assert "token ids must be in [0, 512)" in (errors["out-of-vocab"] or "")
    assert "max_num_batched_tokens" in (errors["wider-than-a-step"] or "")
    assert "context" in (errors["longer-than-context"] or "")
    assert len(tokens(outputs["ok"])) == 6 and outputs["ok"][-1].finish_reason == "length"
    assert tokens(outputs["huge-stop-id"]) == tokens(outputs["ok"])  # greedy, same prompt
    assert wait_until_idle(client) == 0.0


def test_duplicate_request_id_fails_the_duplicate_and_the_original_goes_on(client: SyncMPClient) -> None:
    for req in (
        engine_request("twice", [5, 6, 7], max_tokens=30),
        engine_request("twice", [5, 6, 7]),
        engine_request("other", [8, 9]),
    ):
        client.add_request(req)
    outputs: dict[str, list[EngineCoreOutput]] = {"twice": [], "other": []}

    def completed(request_id: str) -> bool:
        return any(out.finish_reason == "length" for out in outputs[request_id])

    while not (completed("twice") and completed("other")):
        for out in client.get_output(timeout=60).outputs:
            outputs[out.request_id].append(out)
    errors = [out.error for out in outputs["twice"] if out.finish_reason == FINISH_ERROR]
    assert len(errors) == 1 and "already in use" in (errors[0] or "")
    assert len(tokens(outputs["twice"])) == 30
    assert wait_until_idle(client) == 0.0
    assert client.health_problem() is None


def test_a_request_whose_parameters_break_sampling_fails_alone(tiny_llama_dir: Path) -> None:
    engine = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=80, num_threads=1)
    )
    runner = engine.executor.worker.runner  # type: ignore[attr-defined]
    sample = runner.sampler

    def fragile_sampler(logits: Any, metadata: SamplingMetadata) -> Any:
        # Stands in for any parameter combination the batched sampler cannot handle.
        if bool((metadata.temperature == 0.5).any()):
            raise IndexError("injected sampling fault")
        return sample(logits, metadata)

    runner.sampler = fragile_sampler
    engine.add_request(engine_request("fine", [5, 6, 7]))
    engine.add_request(engine_request("fragile", [5, 6, 7], temperature=0.5))
    finished: dict[str, EngineCoreOutput] = {}
    produced: dict[str, int] = {"fine": 0, "fragile": 0}
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            produced[out.request_id] += len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
    assert finished["fragile"].finish_reason == FINISH_ERROR
    assert finished["fragile"].error == "sampling failed (IndexError)"
    assert produced == {"fine": 6, "fragile": 0}
    assert engine.scheduler.kv.usage == 0.0
    engine.shutdown()


def test_a_refused_prompt_registers_no_block_a_concurrent_request_could_reuse(tiny_llama_dir: Path) -> None:
    """Refused before its blocks exist: a prompt sharing its first block, scheduled in the same
    step, must not take an unwritten block from the prefix cache."""
    engine = EngineCore(
        EngineConfig(model=str(tiny_llama_dir), block_size=16, num_kv_blocks=80, num_threads=1)
    )
    try:
        shared = [(7 * i + 3) % 400 + 5 for i in range(16)]
        alone = _greedy_tokens(engine, [("b", [*shared, 40, 41, 42])])["b"]
        with pytest.raises(RequestRejected, match=r"token ids must be in \[0, 512\)"):
            engine.add_request(engine_request("a", [*shared, 100_000]))
        # A wire message of the wrong types is refused the same way, not a TypeError that stops the core.
        for malformed in ([*shared, None], "not a list", 7):
            with pytest.raises(RequestRejected):
                engine.add_request(engine_request("c", malformed))  # type: ignore[arg-type]
        # The sampler's ids too, for a caller of the engine that skipped the frontend's admission.
        for field, sampling in (
            ("logit_bias", {"logit_bias": {600: 1.0}}),
            ("allowed_token_ids", {"allowed_token_ids": [5, 512]}),
        ):
            with pytest.raises(RequestRejected, match=rf"{field} must be in \[0, 512\)"):
                engine.add_request(engine_request("d", [*shared, 40], **sampling))
        assert _greedy_tokens(engine, [("b2", [*shared, 40, 41, 42])])["b2"] == alone
        assert engine.scheduler.kv.usage == 0.0
    finally:
        engine.shutdown()


def _greedy_tokens(engine: EngineCore, prompts: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    for request_id, prompt in prompts:
        engine.add_request(engine_request(request_id, prompt))
    got: dict[str, list[int]] = {request_id: [] for request_id, _ in prompts}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            got[output.request_id] += output.new_token_ids
    return got
