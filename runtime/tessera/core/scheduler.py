"""Continuous batching: which requests run this step, and with how many tokens.

Running requests go first (oldest first), then waiting ones, all under one token
budget, so prefills, chunked prefills and decodes share a step. When blocks run
out, the newest running request is preempted by recompute: its blocks are freed
and it goes back to the front of the waiting queue.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from tessera.config import EngineConfig
from tessera.core.kv_cache_manager import KVCacheManager
from tessera.core.request import Request, RequestRejected, RequestStatus
from tessera.wire.messages import EngineCoreOutput, PromptLogprobs, SchedulerStats
from tessera.wire.sched_output import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _StepBudget:
    """What one step has left: tokens and sequences, and the tokens given each request so far."""

    tokens: int
    seqs: int
    num_tokens: dict[str, int] = field(default_factory=dict)

    def has_room(self) -> bool:
        return self.tokens > 0 and self.seqs > 0

    def take(self, request: Request, count: int) -> None:
        self.num_tokens[request.request_id] = count
        self.tokens -= count
        self.seqs -= 1


class Scheduler:
    def __init__(
        self, config: EngineConfig, num_blocks: int, max_model_len: int, pipeline_depth: int = 1
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        # Batches in flight at once (pipeline stages): each step takes its share of the requests,
        # so every stage has a batch to work on instead of one batch walking down the pipeline.
        self.pipeline_depth = pipeline_depth
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_ids: list[str] = []  # since the last schedule(): workers drop their state
        self.preempted_ids: list[str] = []  # of those, the ones that will come back
        self.discarded_sample_ids: list[str] = []  # of those, the ones whose sample was in flight
        self.num_preemptions = 0  # since the last stats
        self.preempted_this_step = False
        # Serials of request incarnations: a request id reused after an abort, or a request
        # preempted and scheduled again, is a new incarnation, and an output in flight for the
        # old one must not reach it (pipeline parallelism keeps batches in flight).
        self._incarnations = itertools.count()

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; RequestRejected (nothing changed) if it can never run here."""
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise RequestRejected("the prompt must hold at least one token")
        if request.num_tokens >= self.max_model_len:
            raise RequestRejected(
                f"prompt has {request.num_tokens} tokens; the model's context is {self.max_model_len}"
            )
        if not self.enable_chunked_prefill and request.num_tokens > self.max_num_batched_tokens:
            raise RequestRejected(
                f"prompt has {request.num_tokens} tokens; with chunked prefill off one step "
                f"holds at most {self.max_num_batched_tokens} (max_num_batched_tokens)"
            )
        request.incarnation = next(self._incarnations)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        doomed = {rid: self.requests[rid] for rid in request_ids if rid in self.requests}
        if len(doomed) > 1:
            # One pass over the queues for them all: removed one by one, a disconnect storm's
            # thousands of aborts would each scan a long waiting queue (quadratic, in the hot loop).
            self.running[:] = [r for r in self.running if r.request_id not in doomed]
            kept = [r for r in self.waiting if r.request_id not in doomed]
            self.waiting.clear()
            self.waiting.extend(kept)
        for request in doomed.values():
            self._finish(request, RequestStatus.FINISHED_ABORTED, queued=len(doomed) == 1)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _finish(self, request: Request, status: RequestStatus, queued: bool = True) -> None:
        """``queued`` False: the caller already took it out of the queues."""
        # Membership, not status: a request that failed midway may hold either.
        if queued and request in self.running:
            self.running.remove(request)
        if queued and request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self.finished_ids.append(request.request_id)
        if request.request_id in self.preempted_ids:  # preempted, then ended before it came back
            self.preempted_ids.remove(request.request_id)
            if request.request_id in self.discarded_sample_ids:
                self.discarded_sample_ids.remove(request.request_id)

    # -- one step ------------------------------------------------------------------------------
    def _seqs_per_batch(self) -> int:
        active = min(len(self.running) + len(self.waiting), self.max_num_seqs)
        return max(1, -(-active // self.pipeline_depth))

    def schedule(self) -> SchedulerOutput:
        self.preempted_this_step = False
        step = _StepBudget(self.max_num_batched_tokens, self._seqs_per_batch())
        self._schedule_running(step)
        # Admit waiting requests only when nothing was preempted: otherwise they would
        # take the blocks the preempted ones need to come back.
        if not self.preempted_this_step:
            self._schedule_waiting(step)
        return self._make_output(step.num_tokens)

    def _schedule_running(self, step: _StepBudget) -> None:
        """The running requests' next tokens, oldest first, preempting the newest for room."""
        index = 0
        while index < len(self.running) and step.has_room():
            request = self.running[index]
            count = self._tokens_to_schedule(request, step.tokens)
            if count == 0:  # everything in flight already (pipeline parallelism)
                index += 1
                continue
            if not self._allocate_or_preempt(request, count):
                break
            step.take(request, count)
            index += 1

    def _schedule_waiting(self, step: _StepBudget) -> None:
        """Waiting requests in order, each from its longest cached prefix, while they fit."""
        while self.waiting and step.has_room() and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_hit_tokens
            # Without chunked prefill a prompt runs whole; only a request resumed after preemption
            # (prompt + outputs) can exceed a full step, and it is chunked rather than left waiting forever.
            must_be_whole = not self.enable_chunked_prefill and remaining <= self.max_num_batched_tokens
            if must_be_whole and remaining > step.tokens:
                break
            count = min(remaining, step.tokens)
            if self.long_prefill_token_threshold:
                count = min(count, self.long_prefill_token_threshold)
            if not self.kv.allocate_slots(request, count, hits):
                break
            self.kv.record_prefix_lookup(request, num_hit_tokens)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:  # its first schedule: what it found cached, and when
                request.num_cached_tokens = num_hit_tokens
                request.first_scheduled_time = time.time()
            self.running.append(request)
            step.take(request, count)

    def _make_output(self, num_tokens: dict[str, int]) -> SchedulerOutput:
        """What the workers get: each scheduled request's tokens and blocks (its data if new to
        them), and the requests they drop."""
        output = SchedulerOutput()
        if num_tokens:  # an empty step is not sent: its finished ids wait for the next one
            output.finished_request_ids, self.finished_ids = self.finished_ids, []
            output.preempted_request_ids, self.preempted_ids = self.preempted_ids, []
            output.discarded_sample_ids, self.discarded_sample_ids = self.discarded_sample_ids, []
        for request in self.running:
            count = num_tokens.get(request.request_id, 0)
            if count == 0:
                continue
            start = request.num_computed_tokens
            new = None
            if not request.known_to_workers:
                new = self._new_request_data(request)
                request.known_to_workers = True
            output.scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + count],
                    start_position=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sample=start + count == request.num_tokens,
                    new=new,
                )
            )
            output.incarnations[request.request_id] = request.incarnation
            output.num_scheduled_tokens += count
            request.num_computed_tokens = start + count
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
        )

    def _tokens_to_schedule(self, request: Request, budget: int) -> int:
        count = request.num_tokens - request.num_computed_tokens
        if self.long_prefill_token_threshold:
            count = min(count, self.long_prefill_token_threshold)
        return min(count, budget, self.max_model_len - request.num_computed_tokens)

    def _allocate_or_preempt(self, request: Request, count: int) -> bool:
        """Make room by preempting the newest running requests; False if the request itself went."""
        while not self.kv.allocate_slots(request, count):
            victim = self.running.pop()
            self._preempt(victim)
            self.preempted_this_step = True
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # Every token scheduled, yet no output for the last one: its sample is in flight, and
        # will be dropped as stale; the sampling rank rewinds the seeded generator that drew it.
        if request.num_computed_tokens == request.num_tokens:
            self.discarded_sample_ids.append(request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.incarnation = next(self._incarnations)
        request.known_to_workers = False
        self.finished_ids.append(request.request_id)  # workers drop its state; it comes back as new
        self.preempted_ids.append(request.request_id)
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = []
        # The batch's requests still current, each looked up once; a refused one is not among them.
        current: dict[str, Request] = {}
        for scheduled in scheduler_output.scheduled:
            request = self._current(scheduled.request_id, scheduler_output)
            if request is None or scheduled.request_id in runner_output.failed:
                continue  # gone, or refused: its blocks were never written
            current[scheduled.request_id] = request
            self.kv.confirm_computed(
                scheduled.request_id, scheduled.start_position + len(scheduled.token_ids)
            )
        for request_id, reason in runner_output.failed.items():
            request = self._current(request_id, scheduler_output)
            if request is not None:  # a report for an older incarnation fails nothing
                outputs.append(self.fail_request(request, reason))
        for request_id, chunk in runner_output.prompt_logprobs.items():
            request = current.get(request_id)
            if request is not None and not request.prompt_logprobs_sent:
                for offset, entry in enumerate(chunk.entries):
                    request.prompt_logprobs[chunk.first_position + offset] = entry
        for row, request_id in enumerate(runner_output.request_ids):
            request = current.get(request_id)
            if request is None:
                continue
            try:
                outputs.append(self._append_sampled(request, runner_output, row))
            except Exception as error:
                # A fault in one request's bookkeeping fails that request, not the engine.
                logger.exception("request %s failed while processing its output", request_id)
                outputs.append(self.fail_request(request, f"internal error ({type(error).__name__})"))
        return outputs

    def _current(self, request_id: str, scheduler_output: SchedulerOutput) -> Request | None:
        """The request an output is for, unless aborted, preempted, or rescheduled since the batch."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.RUNNING:
            return None  # aborted or preempted while in flight
        if request.incarnation != scheduler_output.incarnations.get(request_id):
            return None  # preempted and rescheduled, or its id reused, while this batch was in flight
        return request

    def _append_sampled(
        self, request: Request, runner_output: ModelRunnerOutput, row: int
    ) -> EngineCoreOutput:
        token_id = runner_output.sampled_token_ids[row]
        request.append_output_token(token_id)
        status = self._check_stop(request, token_id)
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            new_logprobs=[runner_output.logprobs[row]] if runner_output.logprobs else None,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            first_scheduled_time=request.first_scheduled_time,
        )
        if request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            positions = range(1, request.num_prompt_tokens)
            entries = [request.prompt_logprobs[p] for p in positions]  # every chunk has run before a sample
            output.prompt_logprobs = PromptLogprobs(first_position=1, entries=entries)
            request.prompt_logprobs, request.prompt_logprobs_sent = {}, True
        if status is not None:
            self._finish(request, status)
            output.finish_reason = status.finish_reason
            output.stop_reason = request.stop_reason
        return output

    def fail_request(self, request: Request, reason: str) -> EngineCoreOutput:
        """Finish one request with an error: its blocks are freed and its caller told why."""
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=RequestStatus.FINISHED_ERROR.finish_reason,
            error=reason,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv.stats.take()
        preemptions, self.num_preemptions = self.num_preemptions, 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=preemptions,
        )
