"""What both OpenAI endpoints share: errors, model names, SSE, disconnect handling."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tessera.engine.async_llm import AsyncLLM, StreamBacklogError
from tessera.engine.core_client import EngineDeadError
from tessera.engine.errors import RequestFailedError, ServerShuttingDownError
from tessera.entrypoints.limits import ServingLimits
from tessera.entrypoints.protocol import ErrorInfo, ErrorResponse
from tessera.outputs import CompletionOutput
from tessera.sampling_params import RequestRefused

logger = logging.getLogger("tessera.api_server")

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


def refusal_of(exc: Exception) -> RequestRefused:
    """The client's view of an exception: never a traceback or a file path."""
    if isinstance(exc, RequestRefused):
        return exc
    if isinstance(exc, EngineDeadError):  # its text may hold the engine core's traceback
        summary = str(exc).splitlines()[0].rstrip(":") if str(exc) else "no detail"
        return RequestRefused(f"the engine died ({summary})", HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, RequestFailedError):
        return RequestRefused(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)
    if isinstance(exc, ServerShuttingDownError):
        return RequestRefused(str(exc), HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "5"})
    if isinstance(exc, StreamBacklogError):
        return RequestRefused(str(exc), HTTPStatus.REQUEST_TIMEOUT)
    logger.error("request failed", exc_info=exc)
    return RequestRefused(f"internal server error ({type(exc).__name__})", HTTPStatus.INTERNAL_SERVER_ERROR)


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    info = ErrorInfo(message=message, type=error_type, param=param, code=status if code is None else code)
    return ErrorResponse(error=info).model_dump()


class _AsciiJSONResponse(JSONResponse):
    """JSON escaped to ASCII: any text (even a lone surrogate from a request) can be rendered."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = error_body(message, status, param, code)
    return _AsciiJSONResponse(body, status_code=status, headers=headers)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = (
        payload.model_dump_json(exclude_unset=False)
        if isinstance(payload, BaseModel)
        else json.dumps(payload)
    )
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def streams_a_chunk(completion: CompletionOutput) -> bool:
    """A stream sends a chunk for every step that generated tokens, text or not (a held-back stop
    string, part of a character), as vLLM does: its clients count inter-token latency per chunk."""
    return bool(completion.token_ids or completion.text or completion.finish_reason is not None)


async def sse_with_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then [DONE]; a failure midway becomes one error event (the status is sent)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        error = refusal_of(exc)
        yield sse(error_body(error.message, error.status, error.param, error.code))
    yield SSE_DONE


@dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_names: list[str]
    max_waiting_requests: int | None = None
    limits: ServingLimits = field(default_factory=ServingLimits)

    def check_model(self, model: str | None) -> str:
        """The name answers carry: the one the client asked for (any served alias), else the first."""
        if model is None:
            return self.served_model_names[0]
        if model in self.served_model_names:
            return model
        raise RequestRefused(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model")


# Queued requests hold only their prompts: room for a few KV caches' worth of sequences lets a
# queue build for the autoscaler to read (queue depth) while still bounding what one client queues.
WAITING_ROOM_PER_CAPACITY = 4


def default_max_waiting_requests(engine: AsyncLLM) -> int:
    """--max-waiting-requests when not given: WAITING_ROOM_PER_CAPACITY times the sequences the
    KV cache holds at full context length (num_kv_blocks x block_size / max_model_len), or times
    --max-num-seqs when that is more, so one client cannot queue without bound."""
    capacity = engine.kv_capacity_sequences
    return WAITING_ROOM_PER_CAPACITY * max(engine.config.max_num_seqs, capacity or 0)


async def listen_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (aborting its engine requests) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watcher.cancel()
    try:
        return await work_task
    except asyncio.CancelledError:
        if not watcher.done() or watcher.cancelled():
            raise  # the server itself is cancelling this request
        # Nobody reads this answer; it keeps the cancellation out of the server's error log.
        raise RequestRefused("the client disconnected", CLIENT_CLOSED_REQUEST) from None


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several generators as items arrive, tagged with their position; closes all on exit."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    # Bounded: a consumer that stops reading stops the pumps, so each request's own (bounded)
    # output queue fills and the engine aborts it, rather than this queue growing.
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue(len(streams))

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
                continue
            index, value = entry[0], entry[1]
            if isinstance(value, BaseException):
                raise value
            yield index, value
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
