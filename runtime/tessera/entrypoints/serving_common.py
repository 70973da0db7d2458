"""What both OpenAI endpoints share: errors, admission, model names, SSE, disconnect handling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tessera.engine.async_llm import AsyncLLM
from tessera.entrypoints.protocol import ErrorInfo, ErrorResponse

T = TypeVar("T")


class APIError(Exception):
    """An error the client caused or must handle, rendered in OpenAI's format."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    503: "service_unavailable",
}


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=status)
    ).model_dump()


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = (
        payload.model_dump_json(exclude_unset=False)
        if isinstance(payload, BaseModel)
        else json.dumps(payload)
    )
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


@dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_names: list[str]
    max_waiting_requests: int | None = None

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.served_model_names[0]
        raise APIError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, param="model")

    def check_admission(self) -> None:
        engine = self.engine
        if engine.dead_error is not None:
            raise APIError(
                "the engine is not running", HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "5"}
            )
        if self.max_waiting_requests is not None and engine.num_waiting_requests > self.max_waiting_requests:
            raise APIError(
                f"the server is overloaded: {engine.num_waiting_requests} requests are waiting "
                f"(limit {self.max_waiting_requests}); retry later",
                HTTPStatus.SERVICE_UNAVAILABLE,
                headers={"Retry-After": "1"},
            )

    def tokenize(
        self, prompt: str | list[int], add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        try:
            return self.engine.tokenize(prompt, add_special_tokens=add_special_tokens)
        except ValueError as exc:
            raise APIError(str(exc), HTTPStatus.BAD_REQUEST, param=param) from exc


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
    return await work_task


async def merge_streams(streams: list[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several generators as items arrive, tagged with their position; closes all on exit."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, T] | tuple[int, BaseException] | None] = asyncio.Queue()

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
