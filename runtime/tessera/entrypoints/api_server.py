"""The OpenAI-compatible HTTP server: `tessera serve MODEL [options]`.

FastAPI + uvicorn in front of AsyncLLM. build_app assembles it: the transport's guards, the
error handlers, the routes. Errors always use OpenAI's error body; request validation failures
are 400 (not FastAPI's 422); a body too large or too deep is refused before it is parsed
(BodyGuard); what a parsed request may ask for is admission.py's. A request that fails inside
the server gets a 500 alone.
When the engine core dies, /health turns 503, waiting callers get errors, and the process
exits non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.engine.arg_utils import engine_config_from_args
from tessera.engine.async_llm import AsyncLLM
from tessera.engine.core_client import EngineDeadError
from tessera.engine.errors import RequestFailedError, ServerShuttingDownError
from tessera.entrypoints.api_key import ApiKeyGuard
from tessera.entrypoints.body_guard import BodyGuard
from tessera.entrypoints.http_limits import guarded_protocol, raise_open_file_limit
from tessera.entrypoints.in_flight import IN_FLIGHT_PATH, InFlight, InFlightCounter
from tessera.entrypoints.limits import ServingLimits
from tessera.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from tessera.entrypoints.serve_args import add_serve_args
from tessera.entrypoints.serving_chat import create_chat_completion
from tessera.entrypoints.serving_common import (
    ServingContext,
    default_max_waiting_requests,
    error_response,
    refusal_of,
)
from tessera.entrypoints.serving_completions import create_completion
from tessera.entrypoints.serving_tokenize import detokenize, tokenize
from tessera.metrics import METRIC_PREFIXES
from tessera.models.hf_config import UnsupportedModelError
from tessera.sampling_params import RequestRefused
from tessera.version import __version__

logger = logging.getLogger("tessera.api_server")

# Seconds between the engine's death and the server's exit: callers receive their errors first.
DEAD_ENGINE_GRACE_S = 1.0
# On SIGTERM, how long open requests may still run before they are answered with a 503.
SHUTDOWN_GRACE_S = float(os.environ.get("TESSERA_SHUTDOWN_GRACE_S", "5"))

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 415, 500, 503)
}


# What the API key guards: the model's work, and the API's description (which vLLM leaves open).
# /health, /ping, /version and /metrics stay open, as in vLLM, for probes and Prometheus.
DOCS_PATHS = ("/docs", "/redoc", "/openapi.json")
PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize", *DOCS_PATHS)
# The only routes whose request bodies are read; any other body is never read (BodyGuard).
BODY_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
# What `tessera drain` waits for: the requests that run the model.
MODEL_WORK_PATHS = ("/v1/completions", "/v1/chat/completions")


async def require_json(request: Request) -> None:
    """A body of another media type is refused by name (parsed anyway it would fail as a wrong
    type, a message that hides the cause)."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise RequestRefused(
            f"unsupported media type {media_type or '(none)'!r}: send the body as JSON with "
            "Content-Type: application/json",
            HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
        )


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def param_of(loc: Any) -> str | None:
    """pydantic's error location as the request spells it: `messages[0].content`, without the
    union branch pydantic tried (`str`, `list[str]`, `ContentPart`, ...)."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part != "body" and part.isidentifier() and part.islower() and part not in _UNION_TAGS:
            param += f".{part}" if param else part
    return param or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    param = param_of(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {message}", None
    return (f"{param}: {message}" if param else message), param


def build_app(
    ctx: ServingContext,
    api_key: str | None = None,
    allowed_origins: Sequence[str] = (),
    body_timeout: float | None = None,
    docs: bool = True,
) -> FastAPI:
    no_docs: dict[str, Any] = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="Tessera OpenAI-compatible server", lifespan=engine_lifespan(ctx.engine), **no_docs)
    add_error_handlers(app)
    in_flight = InFlight(MODEL_WORK_PATHS)
    add_guards(app, ctx.limits, api_key, allowed_origins, body_timeout)
    # Added last, so it runs first: a request counts from its arrival (its body still coming).
    app.add_middleware(InFlightCounter, in_flight=in_flight)
    add_probe_routes(app, ctx.engine, in_flight)
    add_model_routes(app, ctx)
    add_api_routes(app, ctx)
    return app


def engine_lifespan(engine: AsyncLLM) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # Here, not after serve() returns: uvicorn re-raises a captured SIGTERM once serve() ends.
        # Off the loop: stopping the core takes seconds, and the last responses are still going out.
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    return lifespan


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's body: a schema failure a 400 naming the field (not FastAPI's 422)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code, headers=getattr(exc, "headers", None))

    # Failures of one request: a 4xx refusal (admission's), a 500 for this request alone, a 503
    # when the engine is gone; anything else is a bug, answered without its traceback.
    @app.exception_handler(RequestRefused)
    @app.exception_handler(RequestFailedError)
    @app.exception_handler(ServerShuttingDownError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(Exception)
    async def on_failure(request: Request, exc: Exception) -> JSONResponse:
        error = refusal_of(exc)
        return error_response(error.message, error.status, error.param, error.headers, error.code)


def add_guards(
    app: FastAPI,
    limits: ServingLimits,
    api_key: str | None,
    allowed_origins: Sequence[str],
    body_timeout: float | None,
) -> None:
    """The transport's checks, before any request is parsed."""
    # The last middleware added runs first: the API key is checked before a body is even read.
    app.add_middleware(
        BodyGuard,
        max_body_size=limits.max_request_body_size,
        max_json_depth=limits.max_json_depth,
        body_paths=BODY_PATHS,
        body_timeout=body_timeout,
    )
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key, protected_paths=PROTECTED_PATHS)
    # Added last, so it runs first: a browser's preflight (which carries no key) is answered here.
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"]
        )


def add_probe_routes(app: FastAPI, engine: AsyncLLM, in_flight: InFlight) -> None:
    """What probes and Prometheus read: open even with an API key, as in vLLM; /in-flight for
    `tessera drain`, a pod's preStop hook."""

    @app.get(IN_FLIGHT_PATH)
    async def open_requests() -> dict[str, int]:
        return {"in_flight": in_flight.count}

    @app.api_route("/health", methods=["GET", "HEAD"])
    @app.api_route("/ping", methods=["GET", "POST"])  # SageMaker's probe, as vLLM serves it
    async def health() -> Response:
        problem = engine.health_problem()
        if problem is None:
            return Response(status_code=200)
        return error_response(problem, HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def add_model_routes(app: FastAPI, ctx: ServingContext) -> None:
    def model_card(name: str) -> ModelCard:
        # The served name, never the model's path on the server's disk.
        return ModelCard(id=name, root=name, max_model_len=ctx.engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[model_card(name) for name in ctx.served_model_names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def model(model: str) -> ModelCard:  # the SDK's client.models.retrieve(name)
        return model_card(ctx.check_model(model))


def add_api_routes(app: FastAPI, ctx: ServingContext) -> None:
    """The model's work: each body is JSON, checked by its schema, then admitted (admission.py)."""
    json_body: dict[str, Any] = {"responses": _ERROR_RESPONSES, "dependencies": [Depends(require_json)]}

    @app.post("/v1/completions", response_model=CompletionResponse, **json_body)
    async def completions(body: CompletionRequest, raw_request: Request) -> Any:
        return await create_completion(ctx, body, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, **json_body)
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Any:
        return await create_chat_completion(ctx, body, raw_request)

    @app.post("/tokenize", response_model=TokenizeResponse, **json_body)
    async def tokenize_prompt(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(ctx, body)

    @app.post("/detokenize", response_model=DetokenizeResponse, **json_body)
    async def detokenize_tokens(body: DetokenizeRequest) -> DetokenizeResponse:
        return await detokenize(ctx, body)


class DrainingServer(uvicorn.Server):
    """On SIGTERM, open requests get SHUTDOWN_GRACE_S to finish; then each is answered with a 503
    (a JSON error, or an error event that ends its stream) and aborted, rather than cut off by
    uvicorn's task cancellation (a plain-text 500, or a stream that just stops)."""

    def __init__(self, engine: AsyncLLM, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        def give_up() -> None:
            error = ServerShuttingDownError("the server is shutting down; retry on another replica")
            self.engine.fail_open_requests(error)

        late = asyncio.get_running_loop().call_later(SHUTDOWN_GRACE_S, give_up)
        try:
            await super().shutdown(sockets)
        finally:
            late.cancel()


def api_key_of(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key clients must send (--api-key, else TESSERA_API_KEY), stripped: a Secret made from
    a file usually ends in a newline, which no client sends. Set but empty is an error: it would
    otherwise leave the API open without a word."""
    key = flag if flag is not None else environ.get("TESSERA_API_KEY")
    if key is None:
        return None
    if not key.strip():
        raise ValueError("the API key (--api-key or TESSERA_API_KEY) is set but empty: give one, or unset it")
    return key.strip()


def uvicorn_config(args: argparse.Namespace, app: FastAPI) -> uvicorn.Config:
    """The HTTP server's settings from `tessera serve`'s flags."""
    # Every connection is a file descriptor: room for the limit, the engine's sockets and files.
    open_files = raise_open_file_limit(args.limit_concurrency + 1024)
    if open_files < args.limit_concurrency + 64:
        logger.warning(
            "the open-file limit (%d) is below --limit-concurrency %d: connections beyond it are refused",
            open_files,
            args.limit_concurrency,
        )
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=guarded_protocol(args.timeout_header, args.max_header_size),
        limit_concurrency=args.limit_concurrency,
        timeout_keep_alive=args.timeout_keep_alive,
        # A backstop only: DrainingServer answers what is still open after its grace period.
        timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S) + 5,
        access_log=args.log_level == "debug",
        log_config=None,  # uvicorn's lines go through the root logger: timestamped like ours
    )


def run_server(args: argparse.Namespace) -> int:
    """Serve until stopped; returns the process exit code (1 when the engine core died)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        api_key = api_key_of(args.api_key, os.environ)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    config = engine_config_from_args(args, args.model)
    names = args.served_model_name or [args.model]
    limits = ServingLimits.from_args(args)
    try:
        engine = AsyncLLM(
            config,
            served_model_name=names[0],
            max_stream_backlog=limits.max_stream_backlog,
            metric_prefixes=METRIC_PREFIXES[args.metrics_prefix],
        )
    except UnsupportedModelError as exc:  # the message names the field; a traceback adds nothing
        logger.error("cannot serve %s: %s", args.model, exc)
        return 2
    if limits.max_tokenize_chars is not None:
        engine.processor.max_tokenize_chars = limits.max_tokenize_chars
    max_waiting = args.max_waiting_requests
    if max_waiting is None:
        max_waiting = default_max_waiting_requests(engine)
    ctx = ServingContext(engine, names, max_waiting, limits)
    app = build_app(
        ctx, api_key, args.allowed_origins, body_timeout=args.timeout_body, docs=not args.disable_fastapi_docs
    )
    server = DrainingServer(engine, uvicorn_config(args, app))

    def on_dead(error: EngineDeadError) -> None:
        logger.error("engine core died; shutting the server down")
        asyncio.get_running_loop().call_later(
            DEAD_ENGINE_GRACE_S, lambda: setattr(server, "should_exit", True)
        )

    engine.on_engine_dead(on_dead)
    defaults = engine.processor.sampling_defaults.set_fields()
    if defaults:  # as vLLM says it: a request that sets none of these samples unlike OpenAI's defaults
        logger.info(
            "sampling defaults from the generation config (%s): %s", config.generation_config, defaults
        )
    logger.info(
        "serving %s as %s on http://%s:%d (API key %s; at most %d sequences waiting, %d connections)",
        args.model,
        ", ".join(names),
        args.host,
        args.port,
        "required" if api_key else "not required",
        max_waiting,
        args.limit_concurrency,
    )
    try:
        server.run()  # on uvloop with httptools' parser (uvicorn's "auto"), as vLLM's server runs
    finally:
        engine.shutdown()
    if engine.dead_error is not None:
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tessera serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    sys.exit(run_server(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
