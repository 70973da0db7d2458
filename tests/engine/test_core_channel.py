"""The engine core process against a hostile or broken channel: it survives bad messages, and
the client reports a core that died inside, stopped answering, or got stuck (fake engine core,
real processes and ZeroMQ sockets)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tessera.config import EngineConfig
from tessera.engine import core_proc
from tessera.engine.core_client import EngineDeadError, SyncMPClient
from tessera.wire import serialization
from tessera.wire.messages import EngineCoreOutputs
from tests.distributed.test_rank_faults import exited
from tests.engine.test_wire_decoding import nested_extensions
from tests.serving.fake_core import FakeEngineCore
from tests.serving.test_core_client import collect_until_finished, request

CONFIG = EngineConfig(model="fake")
STALL_TOKEN = 777


class InputKillerCore(FakeEngineCore):
    """Makes the core's input thread die on a b"DIE" frame: a stand-in for any bug in that thread."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        parse = core_proc.parse_input

        def parse_or_die(frames: list[bytes]) -> tuple[bytes, Any]:
            if frames[0] == b"DIE":
                raise RuntimeError("injected input thread death")
            return parse(frames)

        core_proc.parse_input = parse_or_die  # type: ignore[assignment]


class StallingCore(FakeEngineCore):
    """A step that never ends (a hung rank, a deadlock) for a request whose prompt holds STALL_TOKEN."""

    def step(self) -> EngineCoreOutputs:
        if any(STALL_TOKEN in req.prompt_token_ids for req, _ in self.requests.values()):
            time.sleep(600)
        return super().step()


@pytest.fixture
def make_client() -> Iterator[Callable[[type], SyncMPClient]]:
    clients: list[SyncMPClient] = []

    def make(engine_core_cls: type) -> SyncMPClient:
        clients.append(SyncMPClient(CONFIG, engine_core_cls))
        return clients[-1]

    yield make
    for client in clients:
        if client.proc.pid is not None and client.proc.is_alive():
            os.kill(client.proc.pid, signal.SIGCONT)  # a stopped core could not shut down
        client.shutdown()


def wait_for(condition: Callable[[], Any], timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def test_malformed_messages_are_counted_and_the_core_keeps_serving(
    make_client: Callable[[type], SyncMPClient],
) -> None:
    client = make_client(FakeEngineCore)
    malformed: list[list[bytes]] = [
        [b"ADD"],  # one frame
        [b"ADD", b"x", b"y"],  # three frames
        [b"ADD", b"\xc1"],  # not msgpack
        [b"ADD", nested_extensions(200)],  # used to crash the process
        [b"ADD", serialization.encode("not a request")],
        [b"ABORT", serialization.encode(5)],  # would have raised in the busy loop
        [b"BOGUS", serialization.encode(None)],
    ]
    for frames in malformed:
        client._input.send_multipart(frames)
    client.add_request(request("after", 10, 3))
    assert collect_until_finished(client, {"after"}) == {"after": [11, 12, 13]}
    assert wait_for(lambda: client.protocol_errors == len(malformed))
    assert client.health_problem() is None


def test_a_dead_input_thread_fails_the_engine_loudly(make_client: Callable[[type], SyncMPClient]) -> None:
    client = make_client(InputKillerCore)
    client._input.send_multipart([b"DIE", serialization.encode(None)])
    with pytest.raises(EngineDeadError, match="input thread died"):
        while True:
            client.get_output(timeout=15)
    assert client.health_problem() is not None


def test_a_stuck_step_makes_the_core_unhealthy(make_client: Callable[[type], SyncMPClient]) -> None:
    client = make_client(StallingCore)
    client.stall_timeout_s = 1.0
    client.add_request(request("ok", 10, 2))
    collect_until_finished(client, {"ok"})
    assert client.health_problem() is None
    client.add_request(request("stuck", STALL_TOKEN, 2))
    assert "no progress" in wait_for(client.health_problem)


def test_a_core_that_stops_answering_is_unhealthy_until_it_answers_again(
    make_client: Callable[[type], SyncMPClient],
) -> None:
    client = make_client(FakeEngineCore)
    client.heartbeat_timeout_s = 2.0
    assert wait_for(lambda: client.health_problem() is None)
    assert client.proc.pid is not None
    os.kill(client.proc.pid, signal.SIGSTOP)
    assert "not answered" in wait_for(client.health_problem)
    os.kill(client.proc.pid, signal.SIGCONT)
    assert wait_for(lambda: client.health_problem() is None)


def test_sends_never_block_on_a_frozen_core_and_are_delivered_in_order_once_it_answers(
    make_client: Callable[[type], SyncMPClient],
) -> None:
    """The server's event loop sends requests: a core that stops reading (its socket full) must
    not freeze it. What the socket does not take waits in the client and goes out afterwards."""
    client = make_client(FakeEngineCore)
    client.backlog_timeout_s = 1.0
    assert client.proc.pid is not None
    os.kill(client.proc.pid, signal.SIGSTOP)
    ids = [f"r{i}" for i in range(4000)]
    started = time.monotonic()
    for request_id in ids:  # ~2 KB each: far past both sockets' high-water marks
        client.add_request(replace(request(request_id, 5, 1), prompt_token_ids=[1] * 1000 + [5]))
    assert client._backlog, "the socket never filled: the test did not reach the backlog"
    assert time.monotonic() - started < 60  # a blocking send would never have returned
    assert "taken no request" in wait_for(client.health_problem)
    os.kill(client.proc.pid, signal.SIGCONT)
    finished: list[str] = []
    while len(finished) < len(ids):
        finished += [out.request_id for out in client.get_output(timeout=30).outputs if out.finished]
    assert finished == ids  # the fake core serves in arrival order: nothing lost or reordered
    assert wait_for(lambda: client.health_problem() is None and not client._backlog)


def test_a_core_frozen_past_the_fatal_silence_is_killed_and_its_callers_fail(
    make_client: Callable[[type], SyncMPClient],
) -> None:
    client = make_client(FakeEngineCore)
    client.fatal_silence_s = 3.0
    assert client.proc.pid is not None
    client.add_request(request("waiting", 10, 50))
    os.kill(client.proc.pid, signal.SIGSTOP)
    with pytest.raises(EngineDeadError, match="did not answer"):
        while True:
            client.get_output(timeout=30)
    assert wait_for(lambda: not client.proc.is_alive())


def test_a_frontend_killed_outright_takes_its_engine_core_and_ipc_folder_with_it(tmp_path: Any) -> None:
    """SIGKILL leaves the frontend no chance to clean up: the core notices, removes the IPC
    folder the two shared, and exits."""
    import subprocess
    import sys

    from tests.distributed.test_rank_faults import exited

    script = (
        "from tests.engine.test_core_channel import CONFIG\n"
        "from tests.serving.fake_core import FakeEngineCore\n"
        "from tessera.engine.core_client import SyncMPClient\n"
        "client = SyncMPClient(CONFIG, FakeEngineCore)\n"
        "print(client._ipc_dir, client.proc.pid, flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    frontend = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert frontend.stdout is not None
        folder, core_pid = frontend.stdout.readline().split()
        assert os.path.isdir(folder)
        frontend.kill()
        frontend.wait(timeout=10)
        assert wait_for(lambda: not os.path.exists(folder) and exited(int(core_pid)))
    finally:
        if frontend.poll() is None:
            frontend.kill()


def test_consecutive_aborts_that_queued_during_a_step_reach_the_scheduler_as_one_in_order() -> None:
    """A disconnect storm's aborts cost one pass over the scheduler's queues; a request added
    between two aborts (a reused id) still comes after the first and before the second."""
    calls: list[tuple[str, object]] = []

    class Recorder:
        def abort_requests(self, ids: list[str]) -> None:
            calls.append(("abort", list(ids)))

        def add_request(self, request: object) -> None:
            calls.append(("add", request))

        def has_unfinished_requests(self) -> bool:
            return True

    proc = core_proc.EngineCoreProc.__new__(core_proc.EngineCoreProc)  # its loop's logic alone
    proc.engine = Recorder()
    proc.input_queue = queue.Queue()
    for item in [
        (core_proc.ABORT, ["a"]),
        (core_proc.ABORT, ["b", "c"]),
        (core_proc.ADD, "new a"),
        (core_proc.ABORT, ["d"]),
        (core_proc.ABORT, ["e"]),
    ]:
        proc.input_queue.put(item)
    assert proc._handle_queued()
    assert calls == [("abort", ["a", "b", "c"]), ("add", "new a"), ("abort", ["d", "e"])]
    proc.input_queue.put((core_proc.ABORT, ["f"]))
    proc.input_queue.put((core_proc.SHUTDOWN, None))
    assert not proc._handle_queued() and calls[-1] == ("abort", ["f"])


def test_the_frontend_waits_for_its_core_past_the_ranks_startup_limit() -> None:
    """A leader waiting an hour for slow rank pods (image pulls) must be the one to give up, naming
    the rank that never joined; the frontend must not kill it first with a vaguer error."""
    code = "from tessera.engine.core_client import STARTUP_TIMEOUT_S; print(STARTUP_TIMEOUT_S)"
    env = {**os.environ, "TESSERA_RANK_STARTUP_TIMEOUT": "3600", "TESSERA_LOCAL_STARTUP_TIMEOUT": "1200"}
    shown = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(shown.stdout) > 3600


FORGETFUL_SCRIPT = """
import asyncio, sys
from tessera.config import EngineConfig
from tessera.engine.async_llm import AsyncLLM
from tessera.sampling_params import SamplingParams

async def main():
    llm = AsyncLLM(EngineConfig(model=sys.argv[1], num_threads=1, num_kv_blocks=32, max_model_len=128))
    async for out in llm.generate("r0", llm.processor.tokenize("Once upon"), SamplingParams(max_tokens=2)):
        pass
    print("core", llm.core.proc.pid, flush=True)
    if sys.argv[2] == "crash":
        raise RuntimeError("a bug in the script, before any shutdown()")

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("ending", ["returns", "crash"])
def test_a_script_that_never_shuts_its_engine_down_still_exits(
    tiny_llama_dir: Path, tmp_path: Path, ending: str
) -> None:
    """As vLLM's AsyncLLM: the engine core goes at interpreter exit, instead of multiprocessing's
    exit hook waiting for the idle core forever; nor does its socket folder stay behind."""
    script = tmp_path / "forgetful.py"
    script.write_text(FORGETFUL_SCRIPT)
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_llama_dir), ending],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (0 if ending == "returns" else 1), done.stderr[-2000:]
    core_pid = int(done.stdout.split()[1])
    assert exited(core_pid)
    assert not list(tmp_path.glob("tessera-core-*"))
