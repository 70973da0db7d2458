"""The scheduler with batches in flight (pipeline parallelism): each stage gets its share of the
requests, a request in flight is not scheduled again, and a stale output is never applied."""

from tessera.config import EngineConfig
from tessera.core.scheduler import Scheduler
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput
from tests.core.test_scheduler import add


def pipeline_scheduler(num_blocks: int = 64, depth: int = 2) -> Scheduler:
    return Scheduler(EngineConfig(model="unused", block_size=4), num_blocks, 256, pipeline_depth=depth)


def answer(scheduler: Scheduler, output: SchedulerOutput, token: int = 7) -> list:
    sampled = [s.request_id for s in output.scheduled if s.sample]
    return scheduler.update_from_output(
        output, ModelRunnerOutput(request_ids=sampled, sampled_token_ids=[token] * len(sampled))
    )


def test_requests_split_into_one_batch_per_stage_and_in_flight_ones_wait() -> None:
    scheduler = pipeline_scheduler()
    for name in "abcd":
        add(scheduler, name, 3, max_tokens=8)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["a", "b"]
    assert [s.request_id for s in second.scheduled] == ["c", "d"]
    assert not scheduler.schedule().scheduled  # everything is in flight
    answer(scheduler, first)
    third = scheduler.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in third.scheduled] == [("a", 1), ("b", 1)]


def test_finished_ids_wait_for_a_step_that_is_sent() -> None:
    scheduler = pipeline_scheduler()
    add(scheduler, "a", 3, max_tokens=8)
    add(scheduler, "b", 3, max_tokens=8)
    first = scheduler.schedule()
    scheduler.abort_requests(["b"])
    assert not scheduler.schedule().scheduled  # "a" is in flight: nothing to send
    answer(scheduler, first)
    assert scheduler.schedule().finished_request_ids == ["b"]


def test_an_output_for_a_preempted_incarnation_is_dropped() -> None:
    scheduler = pipeline_scheduler(depth=2)
    request = add(scheduler, "a", 3, max_tokens=8)
    stale = scheduler.schedule()
    scheduler._preempt(scheduler.running.pop())  # preempted while its batch is in flight
    fresh = scheduler.schedule()
    assert [s.request_id for s in fresh.scheduled] == ["a"] and fresh.scheduled[0].new is not None
    assert answer(scheduler, stale, token=99) == []
    assert request.output_token_ids == []
    assert [o.new_token_ids for o in answer(scheduler, fresh, token=5)] == [[5]]


def test_a_reused_request_id_never_gets_the_aborted_requests_output() -> None:
    # A client aborts "a" while its batch is in flight and sends a new "a" at once.
    scheduler = pipeline_scheduler(depth=2)
    add(scheduler, "a", 3, max_tokens=8)
    stale = scheduler.schedule()
    scheduler.abort_requests(["a"])
    reused = add(scheduler, "a", 5, max_tokens=8)
    fresh = scheduler.schedule()
    assert answer(scheduler, stale, token=99) == []
    failed = ModelRunnerOutput(request_ids=[], sampled_token_ids=[], failed={"a": "refused"})
    assert scheduler.update_from_output(stale, failed) == []  # the old one's report fails nothing
    assert reused.output_token_ids == [] and "a" in scheduler.requests
    assert [o.new_token_ids for o in answer(scheduler, fresh, token=5)] == [[5]]


def test_a_request_preempted_with_its_sample_in_flight_is_flagged_for_the_rewind() -> None:
    scheduler = pipeline_scheduler(depth=2)
    add(scheduler, "a", 3, max_tokens=8)
    add(scheduler, "b", 3, max_tokens=8)
    first, second = scheduler.schedule(), scheduler.schedule()  # one batch each, both sampling
    answer(scheduler, first)  # "a"'s token arrives; "b"'s is still in flight
    scheduler._preempt(scheduler.running.pop())  # "b"
    scheduler._preempt(scheduler.running.pop())  # "a"
    third = scheduler.schedule()
    assert third.preempted_request_ids == ["b", "a"]
    assert third.discarded_sample_ids == ["b"]
    assert answer(scheduler, second, token=99) == []
