"""`tessera drain` (a leader's preStop hook) against a real server: it waits for an open request,
returns once the server is idle, and says so when its bound cuts the wait short."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx

from tests.serving.server import API_KEY, MODEL_NAME, REPO_ROOT, ServerProcess


def drain(server: ServerProcess, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
    argv = [sys.executable, "-m", "tessera.cli", "drain", "--url", server.base_url, "--interval", "0.1"]
    return subprocess.Popen([*argv, "--min-seconds", "0", *args], env=env, text=True, stderr=subprocess.PIPE)


def in_flight(server: ServerProcess) -> int:
    return int(httpx.get(f"{server.base_url}/in-flight", timeout=5).json()["in_flight"])


def test_drain_waits_for_an_open_request_and_returns_when_idle(server: ServerProcess) -> None:
    body = json.dumps(
        {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 40, "stream": True, "ignore_eos": True}
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as client:
        client.sendall(head + body[:10])  # the request is open while its body is still coming
        deadline = time.monotonic() + 10
        while in_flight(server) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert in_flight(server) == 1
        cut_short = drain(server, "--timeout", "0.5")
        assert cut_short.wait(timeout=30) == 1 and "1 requests still open" in (cut_short.stderr.read() or "")
        waiting = drain(server, "--timeout", "60")
        time.sleep(1.0)
        assert waiting.poll() is None  # still waiting for the open request
        client.sendall(body[10:])
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer  # answered whole
    assert waiting.wait(timeout=30) == 0
    assert in_flight(server) == 0
    idle = drain(server, "--timeout", "60")
    assert idle.wait(timeout=30) == 0  # an idle server: at once
