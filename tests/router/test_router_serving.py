"""`tessera router` over real sockets: two `tessera serve` leaders (tiny model, CPU, one thread
each; the second exports vLLM's metric names) behind one router process reading an endpoints
file, driven with the openai client and httpx."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tessera.router.prompt_hashes import CHAT, COMPLETIONS, PromptHasher
from tests.router.router_process import RouterProcess
from tests.serving.server import MODEL_NAME, ServerProcess, metric_value

pytestmark = pytest.mark.slow

LEADER_ARGS = ("--max-model-len", "1024", "--max-num-seqs", "16")
# About 120 tokens of the tiny tokenizer: several 16-token blocks to hit.
PREFIX = (
    "A paged key-value cache stores attention keys and values in fixed-size blocks of tokens. "
    "Tensor parallelism splits each matrix across devices; pipeline parallelism splits the layers. "
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. "
)
LONG: dict[str, Any] = {"max_tokens": 800, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def leaders(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("leaders")
    with ThreadPoolExecutor(2) as pool:  # both start at once
        first = pool.submit(ServerProcess, tiny_llama_dir, *LEADER_ARGS, api_key=None, log=logs / "a.log")
        second = pool.submit(
            ServerProcess,
            tiny_llama_dir,
            *LEADER_ARGS,
            "--metrics-prefix",
            "vllm",
            api_key=None,
            log=logs / "b.log",
        )
        servers = [first.result(), second.result()]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def endpoints_file(tmp_path_factory: pytest.TempPathFactory, leaders: list[ServerProcess]) -> Path:
    path = tmp_path_factory.mktemp("router") / "endpoints"
    write_endpoints(path, leaders)
    return path


@pytest.fixture(scope="module")
def router(
    tiny_llama_dir: Path, endpoints_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    log = tmp_path_factory.mktemp("router-log") / "router.log"
    args = (
        "--model",
        str(tiny_llama_dir),
        "--hold-max",
        "4",
        "--hold-timeout",
        "60",
        "--max-body-size",
        "64KiB",
    )
    proc = RouterProcess(endpoints_file, *args, log=log)
    yield proc
    proc.stop()


def write_endpoints(path: Path, servers: list[ServerProcess]) -> None:
    staged = path.with_suffix(".new")  # replaced whole, as a ConfigMap's mount is
    staged.write_text("".join(f"{s.base_url}\n" for s in servers))
    staged.replace(path)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s:.0f} s")
        time.sleep(0.05)


def ready_endpoints(router: RouterProcess) -> int:
    return int(httpx.get(f"{router.base_url}/health").json()["ready_endpoints"])


def router_metric(router: RouterProcess, name: str, labels: str = "") -> float:
    page = httpx.get(f"{router.base_url}/metrics").text
    return metric_value(page, name, labels) or 0.0


def sent_to(router: RouterProcess, server: ServerProcess) -> float:
    return router_metric(router, "tessera_router_requests_total", f'endpoint="{server.base_url}"')


def leader_metric(server: ServerProcess, name: str, labels: str = "") -> float:
    """A leader's series under either prefix (the second leader exports vLLM's names)."""
    page = httpx.get(f"{server.base_url}/metrics").text
    for prefix in ("tessera:", "vllm:"):
        value = metric_value(page, prefix + name, labels)
        if value is not None:
            return value
    raise AssertionError(f"{server.base_url}/metrics has no {name}")


def prefix_hits(server: ServerProcess) -> float:
    return leader_metric(server, "prefix_cache_hits_total")


def aborted(server: ServerProcess) -> float:
    return leader_metric(server, "request_success_total", 'finished_reason="abort"')


def client_of(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def complete(router: RouterProcess, prompt: str, **extra: Any) -> str:
    completion = client_of(router.base_url).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=extra.pop("max_tokens", 2),
        temperature=0.0,
        extra_body=extra,
    )
    return completion.choices[0].text


def which_leader(router: RouterProcess, leaders: list[ServerProcess], prompt: str) -> tuple[int, int]:
    """Send one request; (the leader it went to, the other)."""
    before = [sent_to(router, s) for s in leaders]
    complete(router, prompt)
    deltas = [sent_to(router, s) - b for s, b in zip(leaders, before, strict=True)]
    assert sorted(deltas) == [0, 1], deltas
    chosen = deltas.index(1)
    return chosen, 1 - chosen


def test_the_second_leader_exports_vllms_metric_names(leaders: list[ServerProcess]) -> None:
    page = httpx.get(f"{leaders[1].base_url}/metrics").text
    assert metric_value(page, "vllm:num_requests_waiting") == 0.0
    assert metric_value(page, "vllm:kv_cache_usage_perc") is not None
    assert "tessera:" not in page
    assert (
        metric_value(httpx.get(f"{leaders[0].base_url}/metrics").text, "tessera:num_requests_waiting") == 0.0
    )


def test_a_leaders_4xx_is_forwarded_unchanged_and_a_large_body_is_refused(
    leaders: list[ServerProcess], router: RouterProcess
) -> None:
    bad_bodies = {
        "/v1/completions": {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1},
        "/v1/chat/completions": {"model": MODEL_NAME, "messages": []},
    }
    for path, body in bad_bodies.items():
        direct = httpx.post(leaders[0].base_url + path, json=body)
        routed = httpx.post(router.base_url + path, json=body)
        assert direct.status_code == 400
        assert (routed.status_code, routed.json()) == (direct.status_code, direct.json())
    missing = httpx.post(router.base_url + "/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    large = httpx.post(
        router.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x" * 70_000}
    )
    assert large.status_code == 413
    assert "--max-body-size" in large.json()["error"]["message"]


def completion_text(client: openai.OpenAI, stream: bool) -> str:
    if stream:
        chunks = client.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0.0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0.0
    )
    return completion.choices[0].text


def chat_text(client: openai.OpenAI, stream: bool) -> str:
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    if stream:
        chunks = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0.0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=12, temperature=0.0)
    return chat.choices[0].message.content or ""


def test_answers_through_the_router_equal_direct_ones(
    leaders: list[ServerProcess], router: RouterProcess
) -> None:
    direct, routed = client_of(leaders[0].base_url), client_of(router.base_url)
    for stream in (False, True):
        for answer in (completion_text, chat_text):
            expected = answer(direct, stream)
            assert expected and answer(routed, stream) == expected, (answer.__name__, stream)
    assert [m.id for m in routed.models.list().data] == [MODEL_NAME]


def test_the_router_tokenizes_prompts_as_the_leader_does(
    tiny_llama_dir: Path, leaders: list[ServerProcess]
) -> None:
    """Its token ids are the leader's own (its /tokenize), so its hashes are the engine's."""
    hasher = PromptHasher(str(tiny_llama_dir), block_size=16)
    messages = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "Why?"}]
    for path, body, tokenize_body in (
        (COMPLETIONS, {"model": MODEL_NAME, "prompt": PREFIX}, {"model": MODEL_NAME, "prompt": PREFIX}),
        (CHAT, {"model": MODEL_NAME, "messages": messages}, {"model": MODEL_NAME, "messages": messages}),
    ):
        leader = httpx.post(f"{leaders[0].base_url}/tokenize", json=tokenize_body).json()["tokens"]
        assert hasher.prompt_token_ids(path, body) == leader
    assert hasher.prompt_token_ids(CHAT, {"model": MODEL_NAME, "messages": []}) is None  # the leader's 400


def test_a_shared_prefix_sticks_to_one_leader_and_a_new_prefix_goes_to_the_idle_one(
    leaders: list[ServerProcess], router: RouterProcess
) -> None:
    sent_before = [sent_to(router, s) for s in leaders]
    hits_before = [prefix_hits(s) for s in leaders]
    prefix_decisions = router_metric(router, "tessera_router_decisions_total", 'reason="prefix"')
    for i in range(6):
        complete(router, f"{PREFIX}Question {i}: what happened next?")
    sent = [sent_to(router, s) - b for s, b in zip(leaders, sent_before, strict=True)]
    assert sorted(sent) == [0, 6], sent
    holder = sent.index(6)
    wait_for(lambda: prefix_hits(leaders[holder]) - hits_before[holder] >= 5 * 16, "hits counted", 10)
    assert prefix_hits(leaders[1 - holder]) == hits_before[1 - holder]
    assert router_metric(router, "tessera_router_decisions_total", 'reason="prefix"') - prefix_decisions >= 5

    # Three long streams of that prefix stay with its holder; a new prefix then goes elsewhere.
    holder_url = leaders[holder].base_url
    body = {"model": MODEL_NAME, "prompt": f"{PREFIX}And then?", "stream": True, **LONG}
    readers: list[Iterator[str]] = []
    aborted_before = aborted(leaders[holder])
    with httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        for _ in range(3):
            response = streams.enter_context(
                http.stream("POST", f"{router.base_url}/v1/completions", json=body)
            )
            lines = response.iter_lines()
            readers.append(lines)  # kept: a line iterator collected early closes its stream
            assert next(lines).startswith("data: ")
        inflight = router_metric(router, "tessera_router_inflight_requests", f'endpoint="{holder_url}"')
        assert inflight == 3  # the premise: all three still open at the holder
        other, _ = which_leader(router, leaders, "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and punctuation")
        assert other == 1 - holder
    # The clients left: the router closed its leader connections, so the leader aborted the three.
    wait_for(lambda: aborted(leaders[holder]) - aborted_before == 3, "aborted at the leader")


def test_chats_sharing_a_system_prompt_stick_to_one_leader(
    leaders: list[ServerProcess], router: RouterProcess
) -> None:
    """The chat path: the router renders the template and tokenizes as the server does, or the
    hashes would differ from the engine's and the leader would count no hits."""
    client = client_of(router.base_url)
    sent_before = [sent_to(router, s) for s in leaders]
    hits_before = [prefix_hits(s) for s in leaders]
    for i in range(4):
        messages: Any = [{"role": "system", "content": PREFIX}, {"role": "user", "content": f"Question {i}?"}]
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0.0)
    sent = [sent_to(router, s) - b for s, b in zip(leaders, sent_before, strict=True)]
    assert sorted(sent) == [0, 4], sent
    holder = sent.index(4)
    wait_for(lambda: prefix_hits(leaders[holder]) - hits_before[holder] >= 3 * 16, "hits counted", 10)


def stream_to_the_end(router: RouterProcess, prompt: str, started: threading.Event) -> tuple[str, int]:
    stream = client_of(router.base_url).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=int(LONG["max_tokens"]),
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    finish, tokens = "", 0
    for chunk in stream:
        started.set()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return finish, tokens


def test_a_leader_removed_mid_load_finishes_its_open_requests_with_zero_failures(
    leaders: list[ServerProcess], router: RouterProcess, endpoints_file: Path
) -> None:
    prompt = "Tensor parallelism splits each matrix across devices, and drained leaders finish their work. "
    drained, kept = which_leader(router, leaders, prompt)
    started = [threading.Event(), threading.Event()]
    failures: list[BaseException] = []
    stop_load = threading.Event()

    def load(worker: int) -> int:
        done = 0
        while not stop_load.is_set():
            try:
                complete(router, f"Worker {worker} request {done}: the quick brown fox", max_tokens=4)
            except BaseException as exc:
                failures.append(exc)
            done += 1
        return done

    with ThreadPoolExecutor(6) as pool:
        long_streams = [pool.submit(stream_to_the_end, router, prompt, event) for event in started]
        for event in started:
            assert event.wait(30)
        workers = [pool.submit(load, w) for w in range(4)]
        time.sleep(0.5)
        write_endpoints(endpoints_file, [leaders[kept]])
        wait_for(lambda: ready_endpoints(router) == 1, "drained")
        drained_url = leaders[drained].base_url
        open_at_drain = router_metric(router, "tessera_router_inflight_requests", f'endpoint="{drained_url}"')
        sent_at_drain = sent_to(router, leaders[drained])
        time.sleep(1.5)
        stop_load.set()
        served = sum(w.result() for w in workers)
        results = [s.result() for s in long_streams]
    assert open_at_drain >= 2  # the premise: the long streams were still open on the drained leader
    assert results == [("length", LONG["max_tokens"])] * 2
    assert not failures, failures[:3]
    assert served > 10
    assert sent_to(router, leaders[drained]) == sent_at_drain  # nothing new after the drain
    write_endpoints(endpoints_file, leaders)
    wait_for(lambda: ready_endpoints(router) == 2, "both back")


def test_with_no_endpoint_a_request_gets_503_or_is_held_until_one_appears(
    leaders: list[ServerProcess], router: RouterProcess, endpoints_file: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "none"
    empty.write_text("")
    unheld = RouterProcess(empty, log=tmp_path / "unheld.log")
    try:
        start = time.monotonic()
        refused = httpx.post(f"{unheld.base_url}/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        assert time.monotonic() - start < 2.0
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert router_metric(unheld, "tessera_router_requests_at_zero_total") == 1
        assert router_metric(unheld, "tessera_router_unavailable_total", 'reason="no_endpoint"') == 1
    finally:
        unheld.stop()

    write_endpoints(endpoints_file, [])
    wait_for(lambda: ready_endpoints(router) == 0, "at zero")
    at_zero = router_metric(router, "tessera_router_requests_at_zero_total")
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(complete, router, "Held until a leader appears:", max_tokens=3)
        wait_for(lambda: router_metric(router, "tessera_router_held_requests") == 1, "held")
        assert not held.done()
        write_endpoints(endpoints_file, [leaders[0]])
        assert held.result(timeout=30)
    assert router_metric(router, "tessera_router_held_requests") == 0
    assert router_metric(router, "tessera_router_requests_at_zero_total") == at_zero + 1
    write_endpoints(endpoints_file, leaders)
    wait_for(lambda: ready_endpoints(router) == 2, "both back")


def test_a_leader_killed_mid_stream_gives_the_client_an_error_and_the_router_stays_up(
    leaders: list[ServerProcess], router: RouterProcess
) -> None:
    """Last: it kills a leader."""
    prompt = "A leader killed mid-stream: the client must see an error. "
    victim, survivor = which_leader(router, leaders, prompt)
    stream = client_of(router.base_url).completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        stream=True,
        max_tokens=LONG["max_tokens"],
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)
    core = leaders[victim].engine_core_pid()
    os.kill(core, signal.SIGKILL)
    leaders[victim].proc.kill()
    with pytest.raises(openai.APIError, match="closed the connection midway"):
        for _ in chunks:
            pass
    assert httpx.get(f"{router.base_url}/health").status_code == 200
    victim_url = leaders[victim].base_url
    assert (
        router_metric(
            router, "tessera_router_upstream_errors_total", f'endpoint="{victim_url}",kind="midstream"'
        )
        == 1
    )
    # The next requests go to the survivor, whether the poll or a refused connection saw it first.
    before = sent_to(router, leaders[survivor])
    for i in range(3):
        assert complete(router, f"{prompt} after {i}")
    assert sent_to(router, leaders[survivor]) - before == 3
