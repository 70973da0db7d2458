"""The engine core process and its clients, with a fake engine core (real processes and ZMQ sockets)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tessera.config import EngineConfig
from tessera.engine.core_client import AsyncMPClient, EngineDeadError, SyncMPClient
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import EngineCoreOutputs, EngineCoreRequest
from tests.serving.fake_core import CRASH_TOKEN, FakeEngineCore

CONFIG = EngineConfig(model="fake")


def request(request_id: str, last_token: int, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=[1, 2, last_token],
        sampling_params=SamplingParams(max_tokens=max_tokens),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def collect_until_finished(client: SyncMPClient, ids: set[str]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    pending = set(ids)
    while pending:
        outs = client.get_output(timeout=10)
        assert outs.scheduler_stats is not None
        for out in outs.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                pending.discard(out.request_id)
    return tokens


def test_sync_client_round_trip_and_abort() -> None:
    client = SyncMPClient(CONFIG, FakeEngineCore)
    try:
        assert client.ready_info["max_model_len"] == 64
        client.add_request(request("a", 10, 3))
        client.add_request(request("b", 100, 5))
        assert collect_until_finished(client, {"a", "b"}) == {
            "a": [11, 12, 13],
            "b": [101, 102, 103, 104, 105],
        }
        # An aborted request stops producing, and the core publishes idle stats afterwards.
        client.add_request(request("c", 0, 10_000))
        client.get_output(timeout=10)
        client.abort_requests(["c"])
        deadline = time.monotonic() + 10
        while True:
            outs = client.get_output(timeout=10)
            if not outs.outputs and outs.scheduler_stats and outs.scheduler_stats.num_running_reqs == 0:
                break
            assert time.monotonic() < deadline
    finally:
        client.shutdown()
    assert not client.proc.is_alive()


def test_sync_client_fails_callers_when_core_dies() -> None:
    client = SyncMPClient(CONFIG, FakeEngineCore)
    try:
        client.add_request(request("x", CRASH_TOKEN, 3))
        started = time.monotonic()
        with pytest.raises(EngineDeadError):
            while True:
                client.get_output(timeout=10)
        assert time.monotonic() - started < 10
        with pytest.raises(EngineDeadError):
            client.add_request(request("y", 1, 1))
    finally:
        client.shutdown()


async def test_async_client_streams_and_detects_kill() -> None:
    client = AsyncMPClient(CONFIG, FakeEngineCore)
    try:
        await client.add_request_async(request("a", 0, 100_000))
        outs = await asyncio.wait_for(client.get_output_async(), 10)
        assert isinstance(outs, EngineCoreOutputs)
        assert outs.outputs[0].request_id == "a"
        client.proc.kill()
        with pytest.raises(EngineDeadError):
            while True:
                await asyncio.wait_for(client.get_output_async(), 10)
        assert not client.is_alive
    finally:
        client.shutdown()
