import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from tessera_operator.reconcile.workqueue import WorkQueue


async def test_events_for_one_key_collapse_and_never_run_concurrently() -> None:
    running: set[str] = set()
    calls: list[str] = []
    overlap = False
    release = asyncio.Event()

    async def handler(key: object) -> float | None:
        nonlocal overlap
        assert isinstance(key, str)
        overlap = overlap or key in running
        running.add(key)
        calls.append(key)
        await release.wait()
        running.discard(key)
        return None

    queue = WorkQueue(handler, workers=4)
    queue.start()
    queue.add("a")
    await asyncio.sleep(0.01)  # "a" is being processed
    for _ in range(10):
        queue.add("a")  # collapse into one re-run after the current pass
        queue.add("b")
    await asyncio.sleep(0.01)
    release.set()
    for _ in range(100):
        if queue.idle:
            break
        await asyncio.sleep(0.01)
    await queue.stop()
    assert not overlap
    assert calls.count("a") == 2 and calls.count("b") == 1


class FakeClock:
    """Virtual time for the running loop: `loop.time()` reads `now`, and `loop.call_at` timers
    (the queue's only way to wait) are kept here and run when `advance` passes their deadline."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.now = 1000.0
        self.timers: list[asyncio.TimerHandle] = []
        self.delays: list[float] = []  # each timer's delay as asked, in order

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object], *args: object) -> asyncio.TimerHandle:
        handle = asyncio.TimerHandle(when, callback, args, self.loop)
        self.timers.append(handle)
        self.delays.append(when - self.now)
        return handle

    def pending(self) -> list[asyncio.TimerHandle]:
        return sorted((t for t in self.timers if not t.cancelled()), key=lambda t: t.when())

    async def settle(self) -> None:
        for _ in range(20):  # let the workers take what is queued and finish it
            await asyncio.sleep(0)

    async def advance(self, seconds: float) -> None:
        """Move time forward, firing each timer due by then at its own deadline."""
        target = self.now + seconds
        while (due := [t for t in self.pending() if t.when() <= target]) != []:
            timer = due[0]
            self.timers.remove(timer)
            self.now = timer.when()
            timer._run()
            await self.settle()
        self.now = target
        await self.settle()


@contextlib.contextmanager
def fake_clock() -> Iterator[FakeClock]:
    loop = asyncio.get_running_loop()
    clock = FakeClock(loop)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loop, "time", clock.time)
        patch.setattr(loop, "call_at", clock.call_at)
        yield clock


@contextlib.asynccontextmanager
async def key_queued_on_a_fake_clock(
    handler: Callable[[object], Awaitable[float | None]], **options: Any
) -> AsyncIterator[tuple[WorkQueue, FakeClock]]:
    """A started queue that has taken key "k" once, on virtual time; stopped after the block."""
    with fake_clock() as clock:
        queue = WorkQueue(handler, **options)
        queue.start()
        queue.add("k")
        await clock.settle()
        yield queue, clock
        await queue.stop()


async def test_failures_retry_with_a_capped_exponential_backoff() -> None:
    attempts: list[float] = []

    async def handler(key: object) -> float | None:
        attempts.append(asyncio.get_running_loop().time())
        if len(attempts) <= 6:
            raise RuntimeError("transient")
        return None

    async with key_queued_on_a_fake_clock(handler, workers=1, max_retry_delay=3.0) as (_, clock):
        assert attempts == [1000.0]
        await clock.advance(0.49)  # no retry before its backoff is over
        assert attempts == [1000.0]
        await clock.advance(30)
    # 0.5 s doubling per failure, capped at max_retry_delay: 0.5, 1, 2, then 3 (not 4), 3 (not 8), 3
    assert clock.delays == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert clock.pending() == []  # the success returned None: nothing to come back for


async def test_a_key_failing_for_hours_keeps_being_retried_at_the_cap() -> None:
    """Past 1,024 failures 0.5 * 2**n no longer fits a float: the delay must stay at the cap, not
    raise in the worker (which would end that worker and drop the key's retry for good)."""
    failures = 1100  # 9 hours of a handler failing every 30 s

    async def handler(key: object) -> float | None:
        nonlocal failures
        failures -= 1
        if failures >= 0:
            raise RuntimeError("503 from the API server")
        return None

    async with key_queued_on_a_fake_clock(handler, workers=1, max_retry_delay=30.0) as (queue, clock):
        await clock.advance(1100 * 30.0)
        assert failures == -1  # every retry ran, then the success
        assert clock.delays[-5:] == [30.0] * 5 and queue.idle


async def test_a_success_resets_the_backoff_and_a_requeue_fires_no_earlier_than_asked() -> None:
    attempts: list[float] = []
    outcomes: list[float | Exception | None] = [RuntimeError("transient"), 7.0, RuntimeError("again"), None]

    async def handler(key: object) -> float | None:
        attempts.append(asyncio.get_running_loop().time())
        outcome = outcomes[len(attempts) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    async with key_queued_on_a_fake_clock(handler, workers=1) as (_, clock):
        await clock.advance(0.5)  # the retry after the first failure
        assert attempts == [1000.0, 1000.5]
        await clock.advance(6.999)  # the handler asked for 7 s: not a moment sooner
        assert len(attempts) == 2
        await clock.advance(0.001)
        assert attempts[2] == 1007.5
        await clock.advance(0.5)  # a fresh failure after a success backs off from the start again
        assert attempts[3] == 1008.0
        await clock.advance(60)
    assert len(attempts) == 4 and clock.delays == [0.5, 7.0, 0.5]


def pass_recorder() -> tuple[list[float], Callable[[object], Awaitable[float | None]]]:
    """A handler that notes the loop time of each pass, and the list it notes them in."""
    passes: list[float] = []

    async def handler(key: object) -> float | None:
        passes.append(asyncio.get_running_loop().time())
        return None

    return passes, handler


async def test_min_interval_folds_the_echo_of_our_own_writes_into_one_pass() -> None:
    passes, handler = pass_recorder()
    async with key_queued_on_a_fake_clock(handler, workers=2, min_interval=0.6) as (queue, clock):
        await clock.advance(0.05)
        for _ in range(20):  # the events our pass caused (pods ADDED, status MODIFIED)
            queue.add("k")
            await clock.advance(0.005)
        assert passes == [1000.0]
        await clock.advance(0.5)  # 1000.6 is the earliest the key may run again
    assert passes == [1000.0, 1000.6]
    assert clock.pending() == []


async def test_min_interval_does_not_delay_a_key_that_has_been_quiet_long_enough() -> None:
    passes, handler = pass_recorder()
    async with key_queued_on_a_fake_clock(handler, workers=1, min_interval=0.6) as (queue, clock):
        await clock.advance(0.7)
        queue.add("k")
        await clock.settle()
    assert passes == [1000.0, 1000.7] and clock.delays == []


async def test_deleted_keys_leave_no_trace_of_their_last_pass() -> None:
    """A deleted cluster's last pass ends after its DELETED event forgot it; thousands of
    clusters come and go over an operator's life, and their entries must not pile up."""

    async def handler(key: object) -> float | None:
        return None

    with fake_clock() as clock:
        queue = WorkQueue(handler, workers=4, min_interval=1.0)
        queue.start()
        for i in range(3000):
            queue.add(f"gone-{i}")
            await clock.settle()
            await clock.advance(0.01)
        await clock.advance(5.0)
        queue.add("live")
        await clock.settle()
        assert len(queue._last_done) <= 1024 + 1
        await queue.stop()
