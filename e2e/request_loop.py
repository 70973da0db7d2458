"""A client that keeps sending small completions in a thread and records each one's outcome."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import openai


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
