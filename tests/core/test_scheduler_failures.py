"""A request the scheduler or runner cannot serve fails alone: error output, blocks freed, others go on."""

from __future__ import annotations

import pytest

from tessera.core.request import Request, RequestRejected
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import FINISH_ERROR, EngineCoreRequest
from tessera.wire.sched_output import ModelRunnerOutput
from tests.core.test_scheduler import add, make_scheduler, run_step


def test_runner_failures_finish_only_those_requests_with_an_error() -> None:
    scheduler = make_scheduler()
    add(scheduler, "ok", 4, max_tokens=3)
    add(scheduler, "bad", 4, max_tokens=3)
    output = scheduler.schedule()
    runner = ModelRunnerOutput(
        request_ids=["ok"], sampled_token_ids=[7], failed={"bad": "token ids out of range"}
    )
    outs = {o.request_id: o for o in scheduler.update_from_output(output, runner)}
    assert outs["bad"].finish_reason == FINISH_ERROR
    assert outs["bad"].error == "token ids out of range"
    assert outs["ok"].new_token_ids == [7] and not outs["ok"].finished
    assert "bad" in scheduler.finished_ids  # the next schedule tells the workers to drop its state
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv.usage == 0.0


def test_exception_in_one_requests_stop_handling_fails_only_that_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler = make_scheduler()
    add(scheduler, "ok", 4, max_tokens=2)
    add(scheduler, "victim", 4, max_tokens=2)
    check_stop = scheduler._check_stop

    def faulty(request: Request, token_id: int) -> object:
        if request.request_id == "victim":
            raise KeyError("injected")
        return check_stop(request, token_id)

    monkeypatch.setattr(scheduler, "_check_stop", faulty)
    _, outs = run_step(scheduler)
    by_id = {o.request_id: o for o in outs}
    assert by_id["victim"].finish_reason == FINISH_ERROR
    assert by_id["victim"].error == "internal error (KeyError)"
    assert not by_id["ok"].finished
    _, outs = run_step(scheduler)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("ok", "length")]
    assert scheduler.kv.usage == 0.0 and not scheduler.requests


def test_requests_that_can_never_run_are_rejected_before_anything_changes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    add(scheduler, "a", 4)
    with pytest.raises(RequestRejected, match="already in use"):
        add(scheduler, "a", 4)
    with pytest.raises(RequestRejected, match="context"):
        add(scheduler, "long", 300)
    with pytest.raises(RequestRejected, match="max_num_batched_tokens"):
        add(scheduler, "wide", 17)
    with pytest.raises(RequestRejected, match="at least one token"):
        scheduler.add_request(Request("empty", [], SamplingParams(), eos_token_id=None))
    assert list(scheduler.requests) == ["a"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("request_id", 5), ("prompt_token_ids", {"a": 1}), ("prompt_token_ids", [1, -2]), ("eos_token_id", "x")],
)
def test_wire_fields_of_the_wrong_type_are_rejected(field: str, value: object) -> None:
    fields: dict[str, object] = {
        "request_id": "r",
        "prompt_token_ids": [1, 2],
        "sampling_params": SamplingParams(),
        "eos_token_id": None,
        "arrival_time": 0.0,
    }
    fields[field] = value
    with pytest.raises(RequestRejected):
        Request.from_engine_core_request(EngineCoreRequest(**fields))  # type: ignore[arg-type]


def test_resumed_request_longer_than_a_step_is_chunked_not_stuck() -> None:
    # Chunked prefill off: a prompt fits one step, but prompt + outputs after a preemption may not.
    scheduler = make_scheduler(
        num_blocks=8, max_num_batched_tokens=12, enable_chunked_prefill=False, enable_prefix_caching=False
    )
    request = add(scheduler, "a", 10, max_tokens=8)
    for _ in range(4):
        run_step(scheduler)
    assert request.num_tokens == 14
    scheduler._preempt(scheduler.running.pop())
    steps = 0
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
        steps += 1
        assert steps < 20, "the resumed request never ran"
    assert request.num_output_tokens == 8


def cached_prefix_tokens(scheduler, request_id: str) -> int:
    """How many tokens of a fresh request with the shared 12-token prompt the prefix cache serves."""
    request = add(scheduler, request_id, 12, max_tokens=1)
    return scheduler.kv.get_computed_blocks(request)[1]


def test_a_refused_requests_blocks_are_never_served_from_the_prefix_cache() -> None:
    """Blocks are registered when scheduled; a step the runner refused never wrote them."""
    scheduler = make_scheduler()
    add(scheduler, "bad", 12, max_tokens=3)
    output = scheduler.schedule()
    runner = ModelRunnerOutput(request_ids=[], sampled_token_ids=[], failed={"bad": "seed is out of range"})
    scheduler.update_from_output(output, runner)
    assert scheduler.kv.usage == 0.0 and cached_prefix_tokens(scheduler, "later") == 0


def test_blocks_of_a_step_whose_output_never_came_leave_the_prefix_cache() -> None:
    """An offline run interrupted mid-step aborts its requests: the step may never have run."""
    scheduler = make_scheduler()
    add(scheduler, "interrupted", 12, max_tokens=3)
    scheduler.schedule()  # ... and the forward pass raised
    scheduler.abort_requests(["interrupted"])
    assert scheduler.kv.usage == 0.0 and cached_prefix_tokens(scheduler, "later") == 0


def test_blocks_a_step_wrote_stay_cached_after_the_request_ends() -> None:
    scheduler = make_scheduler()
    add(scheduler, "done", 12, max_tokens=3)
    run_step(scheduler)  # the prompt's 3 full blocks are written
    scheduler.abort_requests(["done"])
    # The last token is always recomputed, so 2 of the 3 blocks are served.
    assert cached_prefix_tokens(scheduler, "later") == 8
