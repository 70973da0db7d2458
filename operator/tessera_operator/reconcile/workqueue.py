"""A keyed work queue in the style of client-go's: events only say *which* cluster to look at.

Many events for one cluster collapse into one pending key; a key is never processed by two
workers at once (a key added while it is processed runs again right after); delayed re-adds
implement resyncs and backoff deadlines; failures retry with a capped exponential delay.
A key is not processed again sooner than `min_interval` after its last pass: the burst of
events our own writes cause (pods ADDED, status MODIFIED) folds into one follow-up pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable

from tessera_operator.timeutil import capped_backoff

log = logging.getLogger("tessera_operator.reconcile.workqueue")

Key = Hashable
LAST_DONE_PRUNE_SIZE = 1024
Handler = Callable[[Key], Awaitable[float | None]]


class WorkQueue:
    def __init__(
        self, handler: Handler, workers: int = 16, max_retry_delay: float = 30.0, min_interval: float = 0.0
    ) -> None:
        self._handler = handler
        self._min_interval = min_interval
        self._last_done: dict[Key, float] = {}
        self._workers = workers
        self._max_retry_delay = max_retry_delay
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._processing: set[Key] = set()
        self._dirty: set[Key] = set()
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._failures: dict[Key, int] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def add(self, key: Key) -> None:
        last = self._last_done.get(key)
        if last is not None and self._min_interval > 0 and key not in self._processing:
            wait = last + self._min_interval - asyncio.get_running_loop().time()
            if wait > 0:
                self.add_after(key, wait)
                return
        self._enqueue(key)

    def add_after(self, key: Key, delay: float) -> None:
        """Look at `key` again after `delay` seconds; an earlier pending deadline wins."""
        loop = asyncio.get_running_loop()
        timer = self._timers.get(key)
        deadline = loop.time() + delay
        if timer is not None and not timer.cancelled() and timer.when() <= deadline:
            return
        if timer is not None:
            timer.cancel()
        self._timers[key] = loop.call_at(deadline, self._fire, key)

    def _fire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._enqueue(key)

    def _enqueue(self, key: Key) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def _record_done(self, key: Key) -> None:
        """When `key`'s pass ended, for min_interval. Only the last min_interval's entries matter:
        older ones go once there are many (a deleted cluster's last pass ends after it is forgotten)."""
        now = asyncio.get_running_loop().time()
        self._last_done[key] = now
        if len(self._last_done) > LAST_DONE_PRUNE_SIZE:
            self._last_done = {k: t for k, t in self._last_done.items() if now - t < self._min_interval}

    def forget(self, key: Key) -> None:
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._failures.pop(key, None)
        self._last_done.pop(key, None)

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._work(), name=f"tessera-worker-{i}") for i in range(self._workers)
        ]

    async def stop(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def idle(self) -> bool:
        return not self._queued and not self._processing

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._processing.add(key)
            forget = False
            try:
                requeue = await self._handler(key)
            except asyncio.CancelledError:
                raise
            except Exception:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = capped_backoff(failures, 0.5, self._max_retry_delay)
                log.exception("reconciling %s failed (attempt %d); retrying in %.1fs", key, failures, delay)
                self.add_after(key, delay)
            else:
                self._failures.pop(key, None)
                if requeue is None:
                    forget = True
                else:
                    self.add_after(key, requeue)
            finally:
                self._processing.discard(key)
                if forget:  # nothing to come back for; the key's own DELETED event forgets the rest
                    timer = self._timers.pop(key, None)
                    if timer is not None:
                        timer.cancel()
                self._record_done(key)
                if key in self._dirty:
                    self._dirty.discard(key)
                    self.add(key)
