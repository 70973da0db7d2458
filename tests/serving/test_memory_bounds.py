"""Memory and time one client may take of the server (issue 63): each bound held on a real
`tessera serve` process through real sockets on 127.0.0.1.

Own server: a 1024-token context (so 128 echoed prompts ask for millions of prompt logprobs),
short header and body deadlines, and a small stream backlog, so each bound shows in seconds.
"""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.serving.checks import assert_openai_error, assert_still_serving
from tests.serving.server import MODEL_NAME, ServerProcess, metric_value

CONTEXT = 1024
TIMEOUT_HEADER_S = 2.0
TIMEOUT_BODY_S = 2.0
STREAM_BACKLOG = 16
VOCAB_SIZE = 512


@pytest.fixture(scope="module")
def bounded_server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("bounded-server") / "server.log"
    args = ["--max-model-len", str(CONTEXT), "--max-num-seqs", "8"]
    args += ["--timeout-header", str(TIMEOUT_HEADER_S), "--timeout-body", str(TIMEOUT_BODY_S)]
    args += ["--max-stream-backlog", str(STREAM_BACKLOG)]
    proc = ServerProcess(tiny_llama_dir, *args, api_key=None, log=log)
    yield proc
    proc.stop()


def rss(server: ServerProcess) -> int:
    return int(psutil.Process(server.proc.pid).memory_info().rss)


def post(server: ServerProcess, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=timeout)


def connect(server: ServerProcess, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connect: the window the server sees stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    return sock


def read_response_head(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_echo_with_prompt_logprobs_over_the_cap_is_400_and_builds_nothing(
    bounded_server: ServerProcess,
) -> None:
    """128 full-context prompts x 21 logprobs: 2.7 million entries (about 4 KB each position on an
    unbounded server: gigabytes), refused by the default cap before the engine sees them."""
    prompts = [[(3 + i * 7 + j) % VOCAB_SIZE for j in range(CONTEXT - 1)] for i in range(128)]
    body = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 0}
    before = rss(bounded_server)
    response = post(bounded_server, "/v1/completions", body, timeout=30)
    error = assert_openai_error(response, 400)
    assert error["param"] == "logprobs"
    assert "--max-prompt-logprobs-entries" in error["message"] and str(1 << 20) in error["message"]
    # n repeats the prompt's logprobs in every choice: counted too (25 x 1023 x 21 = 537k
    # entries, over the cap twice over).
    twice = {**body, "prompt": prompts[:25], "n": 2}
    assert_openai_error(post(bounded_server, "/v1/completions", twice, timeout=30), 400)
    grown = rss(bounded_server) - before
    assert grown < 64 * 1024**2, f"the server grew by {grown / 1024**2:.0f} MiB"
    # Under the cap, echo with logprobs scores the prompt as before.
    small = {**body, "prompt": [prompts[0][:16]], "logprobs": 2}
    answer = post(bounded_server, "/v1/completions", small)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"][0]["logprobs"]["tokens"]) == 16


def test_a_body_on_a_probe_or_an_unknown_path_is_never_read(bounded_server: ServerProcess) -> None:
    """Headers that promise 7 MB: the answer comes at once, without a byte of the body, and the
    connection closes (so the body is never read after the answer either)."""
    before = rss(bounded_server)
    for path, status in (("/ping", b" 200 "), ("/no-such-path", b" 404 "), ("/health", b" 405 ")):
        sock = connect(bounded_server)
        try:
            head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 7000000\r\n\r\n".encode()
            sock.sendall(head + b"{" * 1000)
            start = time.monotonic()
            response = read_response_head(sock, timeout=3)
            assert status in response.split(b"\r\n", 1)[0], response
            assert b"connection: close" in response.lower()
            assert time.monotonic() - start < 2
        finally:
            sock.close()
    chunked = connect(bounded_server)
    try:
        chunked.sendall(b"POST /ping HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n")
        assert b" 200 " in read_response_head(chunked, timeout=3).split(b"\r\n", 1)[0]
    finally:
        chunked.close()
    assert rss(bounded_server) - before < 16 * 1024**2
    assert_still_serving(bounded_server)


def test_two_thousand_slow_connections_do_not_exhaust_the_server(bounded_server: ServerProcess) -> None:
    """Slowloris: connections that send nothing, half a header, or a header and a dribble of a
    body. A normal request is served meanwhile; the header and body deadlines close them all."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    partial_header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
    dribbled = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "'
    )
    socks: list[socket.socket] = []
    try:
        for i in range(2000):
            sock = connect(bounded_server)
            kind = i % 4
            if kind == 1:
                sock.sendall(partial_header)
            elif kind == 2:
                sock.sendall(dribbled)
            elif kind == 3:
                sock.sendall(b"G")
            socks.append(sock)
        opened = time.monotonic()
        start = time.monotonic()
        answer = post(
            bounded_server, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        assert time.monotonic() - start < 5
        for sock in socks[2::4]:  # a byte more of each body, as a dribbler sends it
            sock.send(b"a")
        # Every slow connection is closed by the server once its deadline passes.
        selector = selectors.DefaultSelector()
        for sock in socks:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        open_socks = set(socks)
        deadline = opened + TIMEOUT_HEADER_S + TIMEOUT_BODY_S + 8
        statuses: dict[bytes, int] = {}
        while open_socks and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.5):
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data.startswith(b"HTTP/1.1 "):
                    statuses[data[9:12]] = statuses.get(data[9:12], 0) + 1
                if not data:
                    selector.unregister(sock)
                    open_socks.discard(sock)
        assert not open_socks, f"{len(open_socks)} slow connections still open (answers: {statuses})"
        assert statuses.get(b"408", 0) >= 1000, statuses  # the deadlines answered before closing
    finally:
        for sock in socks:
            sock.close()
    assert_still_serving(bounded_server)


def test_a_stream_nobody_reads_is_aborted_and_frees_its_slot(bounded_server: ServerProcess) -> None:
    """A client that asks for a long stream and never reads it: once the socket buffers are full
    the stream's backlog fills, and the request is aborted (its KV blocks freed) rather than
    piling outputs up in the server until it finishes."""

    def aborted() -> float:
        text = httpx.get(f"{bounded_server.base_url}/metrics").text
        return metric_value(text, "tessera:request_success_total", 'finished_reason="abort"') or 0.0

    before = aborted()
    body = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": "Once upon a time",
            "max_tokens": CONTEXT - 16,
            "n": 8,
            "logprobs": 20,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    sock = connect(bounded_server, rcvbuf=4096)
    try:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock.sendall(head + body)
        deadline = time.monotonic() + 60
        while aborted() < before + 8:  # its eight sequences
            assert time.monotonic() < deadline, "the unread stream was never aborted"
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while metric_value(
            httpx.get(f"{bounded_server.base_url}/metrics").text, "tessera:num_requests_running"
        ):
            assert time.monotonic() < deadline, "the aborted request still runs"
            time.sleep(0.2)
    finally:
        sock.close()
    assert "outputs behind; aborting it" in bounded_server.log_path.read_text()
    assert_still_serving(bounded_server)


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/tokenize", {}),
        ("/v1/completions", {"truncate_prompt_tokens": 16, "max_tokens": 1}),
        ("/v1/chat/completions", {"truncate_prompt_tokens": 16, "max_tokens": 1}),
    ],
)
def test_a_huge_text_is_refused_before_it_is_tokenized(
    bounded_server: ServerProcess, path: str, extra: dict[str, Any]
) -> None:
    text = "lorem ipsum " * 580_000  # 7 MB, under the 8 MiB body cap
    body: dict[str, Any] = {"model": MODEL_NAME, **extra}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    start = time.monotonic()
    error = assert_openai_error(post(bounded_server, path, body), 400)
    assert "--max-tokenize-chars" in error["message"], error
    assert time.monotonic() - start < 5
    # A text under the cap is still counted past the context (what /tokenize is for).
    if path == "/tokenize":
        answer = post(bounded_server, path, {"prompt": "lorem ipsum " * 1000})
        assert answer.status_code == 200 and answer.json()["count"] > CONTEXT


def test_models_name_no_path_and_docs_need_the_key(server: ServerProcess) -> None:
    """The shared server has an API key: /docs and /openapi.json are behind it, as the model is."""
    cards = httpx.get(f"{server.base_url}/v1/models", headers=server.headers).json()["data"]
    assert [card["root"] for card in cards] == [MODEL_NAME]
    assert "/" not in json.dumps(cards).replace("\\/", "")
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert_openai_error(httpx.get(f"{server.base_url}{path}"), 401)
    assert httpx.get(f"{server.base_url}/openapi.json", headers=server.headers).status_code == 200


@pytest.fixture(scope="module")
def small_kv_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A KV cache that holds two full-context sequences, one running at a time, and no
    --max-waiting-requests: the waiting room's default is derived from the KV capacity (4 x 2)."""
    log = tmp_path_factory.mktemp("small-kv-server") / "server.log"
    args = ["--max-model-len", str(CONTEXT), "--num-kv-blocks", str(2 * CONTEXT // 16), "--max-num-seqs", "1"]
    proc = ServerProcess(tiny_llama_dir, *args, api_key=None, log=log)
    yield proc
    proc.stop()


def test_the_waiting_room_is_finite_by_default(small_kv_server: ServerProcess) -> None:
    import openai

    base = small_kv_server.base_url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

    def long_stream(prompt: str) -> Any:
        return client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=CONTEXT - 16,
            stream=True,
            extra_body={"ignore_eos": True},
        )

    running = long_stream("first")
    next(iter(running))
    waiting = long_stream("second")
    deadline = time.monotonic() + 30
    while metric_value(httpx.get(f"{base}/metrics").text, "tessera:num_requests_waiting") != 1:
        assert time.monotonic() < deadline, "the second request never showed up as waiting"
        time.sleep(0.1)
    try:
        body = {"model": MODEL_NAME, "prompt": ["a"] * 8, "max_tokens": 2}  # 1 + 8 > 8
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=20)
        error = assert_openai_error(response, 503)
        assert "limit 8" in error["message"], error
    finally:
        running.close()
        waiting.close()
    assert "at most 8 sequences waiting" in small_kv_server.log_path.read_text()
    assert_still_serving(small_kv_server)


def test_headers_larger_than_the_cap_are_431_and_disconnected(bounded_server: ServerProcess) -> None:
    sock = connect(bounded_server)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for _ in range(40):  # 80 KB of headers, over the 64 KiB default, never ended
            try:
                sock.sendall(b"X-Filler: " + b"a" * 2038 + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        response = read_response_head(sock, timeout=5)
        assert response.startswith(b"HTTP/1.1 431 "), response
        # Disconnected: a close, or a reset where the refused headers were still unread.
        with contextlib.suppress(ConnectionResetError):
            assert sock.recv(1) == b""
    finally:
        sock.close()
    assert httpx.get(f"{bounded_server.base_url}/health", timeout=5).status_code == 200
