"""Requests that arrive while no endpoint is Ready (an InferenceCluster scaled to zero) may wait
for one, in a bounded room and for a bounded time: the autoscaler reads how many wait
(tessera_router_held_requests) and scales up from zero; without a hold they get a 503 at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


class HoldRoom:
    def __init__(self, max_held: int, timeout_s: float) -> None:
        self.max_held = max_held  # 0: no hold
        self.timeout_s = timeout_s
        self.held = 0
        self._changed = asyncio.Event()

    def notify(self) -> None:
        """The endpoints changed: every held request looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for(self, ready: Callable[[], bool]) -> bool:
        """True once ``ready()``; False at once when the room is full (or off), or at the timeout."""
        if ready():
            return True
        if self.held >= self.max_held:
            return False
        self.held += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            while not ready():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return ready()
            return True
        finally:
            self.held -= 1
