"""Scheduler behaviour with a stand-in runner output (the real model is exercised in tests/engine)."""

from tessera.config import EngineConfig
from tessera.core.request import Request
from tessera.core.scheduler import Scheduler
from tessera.sampling_params import SamplingParams
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput


def make_scheduler(num_blocks=64, **overrides) -> Scheduler:
    config = EngineConfig(model="unused", block_size=4, **overrides)
    return Scheduler(config, num_blocks=num_blocks, max_model_len=256)


def add(scheduler: Scheduler, request_id: str, num_prompt: int, max_tokens: int = 4, **params) -> Request:
    request = Request(
        request_id,
        list(range(1, num_prompt + 1)),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=0,
    )
    scheduler.add_request(request)
    return request


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    output = scheduler.schedule()
    sampled = [s.request_id for s in output.scheduled if s.sample]
    runner = ModelRunnerOutput(request_ids=sampled, sampled_token_ids=[token] * len(sampled))
    return output, scheduler.update_from_output(output, runner)


def test_chunked_prefill_respects_budget_and_mixes_with_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    add(scheduler, "a", 3)
    add(scheduler, "b", 20)
    output, _ = run_step(scheduler)
    assert {s.request_id: len(s.token_ids) for s in output.scheduled} == {"a": 3, "b": 5}
    assert [s.sample for s in output.scheduled] == [True, False]
    output, _ = run_step(scheduler)
    # "a" decodes one token, "b" continues its prefill with the rest of the budget.
    assert {s.request_id: len(s.token_ids) for s in output.scheduled} == {"a": 1, "b": 7}
    assert output.scheduled[1].start_position == 5


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(scheduler, name, 4)
    output, _ = run_step(scheduler)
    assert [s.request_id for s in output.scheduled] == ["a", "b"]
    assert len(scheduler.waiting) == 1


def test_stop_conditions():
    scheduler = make_scheduler()
    add(scheduler, "len", 4, max_tokens=2)
    add(scheduler, "eos", 4, max_tokens=10)
    add(scheduler, "stop_id", 4, max_tokens=10, stop_token_ids=[5])
    add(scheduler, "ignore", 4, max_tokens=2, ignore_eos=True)
    output = scheduler.schedule()
    tokens = {"len": 9, "eos": 0, "stop_id": 5, "ignore": 0}
    ids = [s.request_id for s in output.scheduled]
    outs = scheduler.update_from_output(
        output, ModelRunnerOutput(request_ids=ids, sampled_token_ids=[tokens[i] for i in ids])
    )
    finished = {o.request_id: (o.finish_reason, o.stop_reason) for o in outs if o.finished}
    assert finished == {"eos": ("stop", None), "stop_id": ("stop", 5)}
    _, outs = run_step(scheduler, token=9)
    finished = {o.request_id: o.finish_reason for o in outs if o.finished}
    assert finished == {"len": "length", "ignore": "length"}
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.usage == 0.0


def test_preemption_by_recompute_frees_and_resumes():
    # 6 blocks of 4 tokens: two 8-token prompts fit, growing past that forces preemption.
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    add(scheduler, "a", 8, max_tokens=12)
    add(scheduler, "b", 8, max_tokens=12)
    preempted = False
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = run_step(scheduler)
        if "b" in output.finished_request_ids and scheduler.requests.get("b"):
            preempted = True
            assert scheduler.requests["b"].num_computed_tokens == 0
    assert preempted
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv.usage == 0.0
    assert scheduler.make_stats().num_preemptions >= 1


def test_resumed_request_is_sent_again_with_its_outputs():
    scheduler = make_scheduler(num_blocks=6, enable_prefix_caching=False)
    add(scheduler, "a", 8, max_tokens=12)
    add(scheduler, "b", 8, max_tokens=12)
    seen_new_after_preemption = False
    was_preempted = False
    for _ in range(40):
        if not scheduler.has_unfinished_requests():
            break
        output, _ = run_step(scheduler)
        if "b" in output.finished_request_ids:
            was_preempted = True
        for s in output.scheduled:
            if s.request_id == "b" and was_preempted and s.new is not None:
                seen_new_after_preemption = True
                assert s.new.output_token_ids, "a resumed request carries the outputs it had"
                assert s.start_position == 0
    assert was_preempted and seen_new_after_preemption


def test_abort_frees_blocks_everywhere():
    scheduler = make_scheduler()
    add(scheduler, "a", 10)
    add(scheduler, "b", 10)
    run_step(scheduler)
    add(scheduler, "c", 10)
    scheduler.abort_requests(["a", "c", "unknown"])
    assert [r.request_id for r in scheduler.running] == ["b"]
    assert not scheduler.waiting
    output, outs = run_step(scheduler)
    assert set(output.finished_request_ids) == {"a", "c"}
    assert [o.request_id for o in outs] == ["b"]
    scheduler.abort_requests(["b"])
    assert scheduler.kv.usage == 0.0


def test_aborting_many_at_once_keeps_the_rest_in_their_order():
    scheduler = make_scheduler(num_blocks=64, max_num_seqs=1)
    for index in range(200):
        add(scheduler, f"r{index}", 3)
    run_step(scheduler)  # r0 runs, the rest wait
    doomed = [f"r{index}" for index in range(198, -1, -3)]  # from the back, down to the runner r0
    scheduler.abort_requests([*doomed, doomed[0], "unknown"])  # repeats and strangers are harmless
    survivors = [f"r{index}" for index in range(200) if f"r{index}" not in doomed]
    assert not scheduler.running and [r.request_id for r in scheduler.waiting] == survivors
    assert set(scheduler.requests) == set(survivors)
    output, _ = run_step(scheduler)
    assert set(output.finished_request_ids) == set(doomed)
    scheduler.abort_requests(survivors)
    assert not scheduler.waiting and not scheduler.running and scheduler.kv.usage == 0.0


def test_prefix_cache_stats_count_hits():
    scheduler = make_scheduler()
    add(scheduler, "a", 12, max_tokens=1)
    run_step(scheduler)
    scheduler.make_stats()
    add(scheduler, "b", 12, max_tokens=1)
    output, _ = run_step(scheduler)
    assert output.scheduled[0].start_position == 8  # two cached blocks, last token recomputed
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12, 8)


def test_prefix_lookups_are_not_counted_when_the_cache_is_not_consulted():
    # No data rather than a 0% hit rate: with caching off, or for a prompt whose logprobs are asked.
    scheduler = make_scheduler(enable_prefix_caching=False)
    add(scheduler, "a", 12, max_tokens=1)
    run_step(scheduler)
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    scheduler = make_scheduler()
    add(scheduler, "scored", 12, max_tokens=1, prompt_logprobs=0)
    run_step(scheduler)
    assert scheduler.make_stats().prefix_cache_queries == 0


def test_first_scheduled_time_ends_queueing_not_prefill():
    # Queue time (vLLM's definition) is arrival to first schedule: a prompt prefilled in several
    # chunks reports the time of its first chunk.
    scheduler = make_scheduler(max_num_batched_tokens=4)
    request = add(scheduler, "a", 10, max_tokens=2)
    run_step(scheduler)
    first = request.first_scheduled_time
    assert first > 0
    outputs = []
    for _ in range(4):
        outputs += run_step(scheduler)[1]
    assert outputs and outputs[0].new_token_ids and outputs[0].first_scheduled_time == first
