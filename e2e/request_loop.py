"""A client that keeps sending small completions in a thread and records each one's outcome."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2  # the HTTP library this openai client is built on
import openai


def connection_per_request_client(base_url: str, **options: Any) -> openai.OpenAI:
    """An OpenAI client that opens a new connection per request: each one goes through the
    Service's load balancing again instead of staying pinned to one pod by keep-alive."""
    http_client = openai.DefaultHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
    return openai.OpenAI(base_url=base_url, api_key="unused", http_client=http_client, **options)


@dataclass
class Outcome:
    started: float  # time.monotonic()
    finished: float
    error: str | None = None


@dataclass
class RequestLoop:
    client: openai.OpenAI
    model: str
    prompt: str = "Hello"
    max_tokens: int = 4
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RequestLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            error = None
            try:
                self.client.completions.create(
                    model=self.model, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0
                )
            except openai.APIError as exc:
                error = repr(exc)
            self.outcomes.append(Outcome(started, time.monotonic(), error))

    def failures(self) -> list[str]:
        return [o.error for o in self.outcomes if o.error is not None]

    def served_between(self, start: float, end: float) -> int:
        return sum(1 for o in self.outcomes if o.error is None and start <= o.started and o.finished <= end)
