"""AsyncLLM: the serving frontend of the engine.

Tokenizes in the API process, hands requests to the engine core process through
AsyncMPClient, and runs one output-handler task that detokenizes (OutputProcessor) and
routes each request's outputs to the async generator its caller iterates. Closing or
cancelling that generator (a client disconnect) aborts the request in the engine core,
which frees its KV blocks. A request that fails on its own (in output processing, or as the
engine core reports) raises RequestFailedError from its generator and is aborted; the others
go on. If the engine core dies, every open generator raises EngineDeadError and the
registered callbacks run (the server then exits). Tokenizing and chat templating run on a
thread of their own, so a long prompt never stalls the event loop; a long text goes to a second
thread with its own tokenizer, a few at a time, so it never makes short requests wait.

Memory per stream is bounded: a caller that leaves more than `max_stream_backlog` outputs
unread (a client that does not read its stream) has its request aborted, which frees its KV
blocks, and gets StreamBacklogError.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from tessera.config import EngineConfig
from tessera.engine.core_client import AsyncMPClient, EngineDeadError
from tessera.engine.output_processor import FINISH_ERROR, OutputProcessor, RequestOutputKind
from tessera.engine.processor import InputProcessor, load_tokenizer
from tessera.engine.token_bytes import TokenBytes
from tessera.metrics import PREFIX as METRIC_PREFIX
from tessera.metrics import EngineMetrics
from tessera.models.registry import resolve_model
from tessera.models.support import check_model_folder
from tessera.outputs import RequestOutput
from tessera.sampling_params import RequestRefused, SamplingParams
from tessera.wire.messages import FINISH_ABORT, EngineCoreOutputs, SchedulerStats

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Texts longer than this (characters) are tokenized on the long-text thread, at most
# MAX_LONG_TEXT_JOBS at a time (running or queued); beyond that a request is answered 503.
LONG_TEXT_CHARS = 32_768
MAX_LONG_TEXT_JOBS = 4
DEFAULT_MAX_STREAM_BACKLOG = 1024


class TokenizerBusyError(RequestRefused):
    """Too many long texts are being tokenized: retry later (503)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})


class StreamBacklogError(Exception):
    """The caller left too many outputs unread: its request was aborted."""


@dataclass
class _ChildTiming:
    """Frontend-side timings of one engine request, for the latency histograms."""

    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Stream:
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    children: list[str] = field(default_factory=list)


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        served_model_name: str | None = None,
        engine_core_cls: type | None = None,
        max_stream_backlog: int = DEFAULT_MAX_STREAM_BACKLOG,
        metric_prefixes: tuple[str, ...] = (METRIC_PREFIX,),
    ) -> None:
        self.config = config
        self.max_stream_backlog = max_stream_backlog
        self.model_dir = resolve_model(config.model)  # converts once here, so the core finds it cached
        # A model the engine cannot run fails here, naming the field, before any process starts.
        check_model_folder(self.model_dir, config.parallel)
        self.served_model_name = served_model_name or config.model
        # Load the tokenizer (slow imports) while the engine core process loads the model.
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(load_tokenizer, self.model_dir)
            self.core = AsyncMPClient(config, engine_core_cls)
            try:
                self.max_model_len = int(self.core.ready_info["max_model_len"])
                self.processor = InputProcessor.from_model_dir(
                    self.model_dir, self.max_model_len, config, tokenizer.result()
                )
            except BaseException:
                # The engine core process is not a daemon: left running, the server would wait
                # for it at exit forever (a pod Running instead of crash-looping).
                self.core.shutdown()
                raise
        self.tokenizer = self.processor.tokenizer
        self.token_bytes = TokenBytes(self.tokenizer)
        # One thread: the tokenizer is not safe to call from several threads at once.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-tokenizer")
        # Long texts: a thread and a tokenizer of their own (made on first use), so they queue
        # behind each other, never in front of short requests.
        self._long_text_pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-tokenizer-long")
        self._long_text_processor: InputProcessor | None = None
        self._long_text_jobs = 0
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(self.served_model_name, prefixes=metric_prefixes)
        self.last_stats = SchedulerStats()
        self.dead_error: EngineDeadError | None = None
        self._streams: dict[str, _Stream] = {}
        self._timings: dict[str, _ChildTiming] = {}
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._handler: asyncio.Task[None] | None = None

    # --- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the output handler on the running loop (idempotent)."""
        if self._handler is None:
            self._handler = asyncio.get_running_loop().create_task(self._output_handler())

    def on_engine_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        self._dead_callbacks.append(callback)

    @property
    def is_healthy(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now (dead, deaf, stuck), or None."""
        if self.dead_error is not None:
            return "the engine core has failed"
        return self.core.health_problem()

    def fail_open_requests(self, error: BaseException) -> None:
        """End every open request with `error` (the server is stopping): callers answer at once."""
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            stream.queue.put_nowait(error)
            self.abort(request_id)

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._long_text_pool.shutdown(wait=False, cancel_futures=True)
        self.core.shutdown()

    # --- load -----------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return len(self._timings)

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests submitted but not yet running (fresher than the core's last stats)."""
        return max(0, len(self._timings) - self.last_stats.num_running_reqs)

    @property
    def kv_capacity_sequences(self) -> int | None:
        """How many sequences of full context length the KV cache holds (None: not reported)."""
        info = getattr(self.core, "ready_info", None) or {}
        blocks, block_size = info.get("num_kv_blocks"), info.get("block_size")
        if not isinstance(blocks, int) or not isinstance(block_size, int):
            return None
        return max(1, blocks * block_size // max(1, self.max_model_len))

    # --- requests -------------------------------------------------------------------------
    async def tokenize_async(self, prompt: str | list[int], **options: Any) -> list[int]:
        """InputProcessor.tokenize (same options) off the event loop; InvalidParameterError for
        an empty, invalid or over-long prompt (its length checked here, before any queueing)."""
        if isinstance(prompt, str):
            truncated = options.get("keep_last") is not None
            self.processor.check_text_length(prompt, options.get("param", "prompt"), truncated)
            if len(prompt) > LONG_TEXT_CHARS:
                return await self._long_text(lambda p: p.tokenize(prompt, **options))
        return await self._off_loop(functools.partial(self.processor.tokenize, prompt, **options))

    async def encode_async(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """Token ids of a text, unchecked against the context (for /tokenize), within
        max_tokenize_chars."""
        self.processor.check_text_length(text, param)
        if len(text) > LONG_TEXT_CHARS:
            return await self._long_text(lambda p: p.encode(text, add_special_tokens, param))
        return await self._off_loop(self.processor.encode, text, add_special_tokens, param)

    async def _long_text(self, work: Callable[[InputProcessor], T]) -> T:
        if self._long_text_jobs >= MAX_LONG_TEXT_JOBS:
            raise TokenizerBusyError(
                f"{self._long_text_jobs} long texts are being tokenized; retry later or send a shorter one"
            )
        self._long_text_jobs += 1
        try:

            def run() -> T:
                if self._long_text_processor is None:  # a tokenizer of its own: never two threads on one
                    processor = copy.copy(self.processor)
                    processor.tokenizer = copy.deepcopy(self.processor.tokenizer)
                    self._long_text_processor = processor
                return work(self._long_text_processor)

            return await asyncio.get_running_loop().run_in_executor(self._long_text_pool, run)
        finally:
            self._long_text_jobs -= 1

    async def render_chat_async(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        return await self._off_loop(self.processor.render_chat, messages, add_generation_prompt)

    async def _off_loop(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, function, *args)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request as the engine produces them; closing the generator aborts it."""
        if self.dead_error is not None:
            raise self.dead_error
        self.start()
        arrival = time.time()
        children = self.processor.process(request_id, prompt_token_ids, params, arrival, cache_salt)
        self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, children, output_kind)
        stream = _Stream(children=[child.request_id for child in children])
        self._streams[request_id] = stream
        finished = False
        try:
            for child in children:
                self._timings[child.request_id] = _ChildTiming(arrival, len(prompt_token_ids))
                await self.core.add_request_async(child)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request: forget it here and free its KV blocks in the engine core."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.output_processor.abort_requests([request_id])
        now = time.time()
        for child_id in stream.children:
            self._finish_child(child_id, FINISH_ABORT, now)
        if self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                self.core.abort_requests(stream.children)
        logger.info("aborted request %s", request_id)

    # --- the output handler ------------------------------------------------------------------
    async def _output_handler(self) -> None:
        try:
            while True:
                outputs = await self.core.get_output_async()
                self._process(outputs)
        except EngineDeadError as exc:
            self._on_dead(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave callers hanging
            logger.exception("output handler failed")
            self._on_dead(EngineDeadError(f"output handler failed: {exc!r}"))

    def _process(self, outputs: EngineCoreOutputs) -> None:
        now = time.time()
        self._record_metrics(outputs, now)
        processed = self.output_processor.process_outputs(outputs)
        for request_output in processed.request_outputs:
            stream = self._streams.get(request_output.request_id)
            if stream is None:
                continue
            if stream.queue.qsize() >= self.max_stream_backlog:
                self._abort_slow_reader(request_output.request_id, stream)
                continue
            stream.queue.put_nowait(request_output)
            if request_output.finished:
                del self._streams[request_output.request_id]
        for request_id, error in processed.failed.items():
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(error)
                for child_id in stream.children:
                    self._finish_child(child_id, FINISH_ERROR, now)
        if processed.reqs_to_abort:
            # Stop strings (or a failure) end these in the frontend; the engine core must stop them.
            for child_id in processed.reqs_to_abort:
                self._finish_child(child_id, "stop", now)
            self.core.abort_requests(processed.reqs_to_abort)

    def _abort_slow_reader(self, request_id: str, stream: _Stream) -> None:
        """Its caller has left max_stream_backlog outputs unread: drop them, stop the request
        (its KV blocks are freed), and end its stream with an error."""
        unread = stream.queue.qsize()
        while not stream.queue.empty():
            stream.queue.get_nowait()
        stream.queue.put_nowait(
            StreamBacklogError(
                f"the client left {unread} outputs of its stream unread (at most {self.max_stream_backlog}, "
                "--max-stream-backlog); the request was aborted"
            )
        )
        logger.warning("request %s: its reader is %d outputs behind; aborting it", request_id, unread)
        self.abort(request_id)

    def _record_metrics(self, outputs: EngineCoreOutputs, now: float) -> None:
        if outputs.scheduler_stats is not None:
            self.last_stats = outputs.scheduler_stats
            self.metrics.record_scheduler_stats(outputs.scheduler_stats)
        made = outputs.timestamp or now
        for output in outputs.outputs:
            timing = self._timings.get(output.request_id)
            if timing is None:
                continue
            if output.new_token_ids:
                self.metrics.record_generation_tokens(len(output.new_token_ids))
                if timing.first_token_time is None:
                    timing.first_token_time = now
                    # Queued until first scheduled (vLLM's definition): earlier prefill chunks are not queueing.
                    scheduled = output.first_scheduled_time or now
                    queue_time = scheduled - timing.arrival_time
                    self.metrics.record_first_token(
                        timing.num_prompt_tokens, now - timing.arrival_time, queue_time
                    )
                elif timing.last_token_time is not None:
                    self.metrics.record_inter_token_latency(made - timing.last_token_time)
                timing.last_token_time = made
            if output.finish_reason is not None:
                self._finish_child(output.request_id, output.finish_reason, now)

    def _finish_child(self, child_id: str, reason: str, now: float) -> None:
        timing = self._timings.pop(child_id, None)
        if timing is not None:
            self.metrics.record_finished(reason, now - timing.arrival_time)

    def _on_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        self._streams.clear()
        self._timings.clear()
        for callback in self._dead_callbacks:
            callback(error)
