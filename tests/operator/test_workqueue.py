import asyncio

from tessera_operator.workqueue import WorkQueue


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


async def test_failures_retry_and_requeue_delays_are_honoured() -> None:
    attempts = 0
    done = asyncio.Event()

    async def handler(key: object) -> float | None:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("transient")
        if attempts == 2:
            return 0.05  # look again soon
        done.set()
        return None

    queue = WorkQueue(handler, workers=1)
    queue.start()
    queue.add("k")
    await asyncio.wait_for(done.wait(), timeout=5)
    await queue.stop()
    assert attempts == 3


async def test_min_interval_folds_the_echo_of_our_own_writes_into_one_pass() -> None:
    passes = 0

    async def handler(key: object) -> float | None:
        nonlocal passes
        passes += 1
        return None

    # The burst below takes 0.15-0.2 s on a busy 2-core VM (sleeps overshoot): the interval
    # leaves it a wide margin, so the count does not hinge on the machine's timer slack.
    queue = WorkQueue(handler, workers=2, min_interval=0.6)
    queue.start()
    queue.add("k")
    await asyncio.sleep(0.05)
    for _ in range(20):  # the events our pass caused (pods ADDED, status MODIFIED)
        queue.add("k")
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.8)
    await queue.stop()
    assert passes == 2
