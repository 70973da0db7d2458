"""A request the scheduler or runner cannot serve fails alone: error output, blocks freed, others go on."""

from __future__ import annotations

import pytest

from tessera.core.request import Request, RequestRejected
from tessera.core.sched_output import ModelRunnerOutput
from tessera.engine.messages import FINISH_ERROR, EngineCoreRequest
from tessera.sampling_params import SamplingParams
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
