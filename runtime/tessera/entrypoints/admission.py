"""What a request must pass before the engine does any work for it: `admit()`, the one place.

A request meets its refusals in this order (a chat's message count comes first, before its
body is read further); each check runs once, and every refusal after the schema's is one
error, RequestRefused (message, HTTP status, `param`, OpenAI's `code`, headers such as
Retry-After), which the API server renders as OpenAI's error body.

Before a request exists (transport; they judge bytes and connections, not a request):
  - http_limits: header size and time (431, disconnect); api_key: the bearer key (401);
  - body_guard.BodyGuard: body bytes, JSON nesting depth and body time, before parsing (413, 408);
  - api_server.require_json: the media type (415).
The schema (protocol.py, pydantic): the JSON's shape, types and per-field ranges, valid Unicode;
the API server's validation handler turns a failure into a 400 naming the field.

Here, `admit()` (generation) and `admit_tokenize()` / `admit_detokenize()` (vLLM's extras):
  1. the model name is one served (ServingContext.check_model, 404);
  2. the body as SamplingParams (protocol's to_sampling_params: fields Tessera does not implement,
     best_of, suffix, max_tokens 0 without echo, stream_options without stream, response_format,
     tools, top_logprobs without logprobs, logit_bias keys; then SamplingParams' own ranges);
  3. the server's caps (ServingLimits: chat messages, prompts, n, sequences, stop strings and
     their length, stop token ids, logprobs / top_logprobs);
  4. the model's bounds (InputProcessor.check_params: token ids in its vocabulary, logprobs);
  5. a chat's messages (text content parts, tool calls' JSON arguments) through the model's chat
     template (a failure is a 400); then each prompt: text length before tokenizing (the
     context, --max-tokenize-chars), token ids in the vocabulary, not empty, fits the context
     (InputProcessor.tokenize, off the event loop; TokenizerBusyError, a 503, when too many long
     texts are being tokenized);
  6. prompt plus completion fits the context (max_tokens, or the room left for min_tokens);
  7. echo's prompt logprob entries (ServingLimits.check_prompt_logprobs);
  8. the engine can serve now and its waiting room holds the request's sequences (503).
Each judgment stays with what knows its bounds (limits.py the caps, the InputProcessor the
model and tokenizer); this module is the recipe that runs them, in that order.

After admission: the engine core checks again what arrives over the wire (EngineCore.add_request,
Request.from_engine_core_request), as any process reading a socket must. The offline LLM, which
has no server and so none of its caps, admits with SamplingParams' ranges, 4 and 5
(InputProcessor.check_request and .tokenize).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from tessera.engine.processor import CONTEXT_LENGTH_EXCEEDED
from tessera.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    template_messages,
)
from tessera.entrypoints.serving_common import ServingContext, default_max_waiting_requests
from tessera.sampling_params import InvalidParameterError, RequestRefused, SamplingParams


@dataclass(frozen=True)
class Admitted:
    """What the engine needs of an admitted generation request."""

    model: str  # the served name its answers carry
    params: SamplingParams
    prompts: list[list[int]]  # each prompt's token ids
    # Each prompt's text as the model saw it, where the request gave it (a truncated or
    # token-id prompt: None); a chat's rendered template.
    texts: list[str | None]


async def admit(ctx: ServingContext, body: CompletionRequest | ChatCompletionRequest) -> Admitted:
    """The request's parameters and prompts, checked against the server's limits and the model;
    RequestRefused naming the first one refused."""
    if isinstance(body, ChatCompletionRequest):
        admitted = await _admit_chat(ctx, body)
    else:
        admitted = await _admit_completion(ctx, body)
    check_room(ctx, len(admitted.prompts) * admitted.params.n)
    return admitted


async def _admit_completion(ctx: ServingContext, body: CompletionRequest) -> Admitted:
    model = ctx.check_model(body.model)
    params = body.to_sampling_params(ctx.engine.processor.sampling_defaults)
    prompts = body.prompts()
    check_params(ctx, params, len(prompts))
    keep_last = body.truncate_prompt_tokens
    token_lists = [
        await ctx.engine.tokenize_async(
            p,
            add_special_tokens=body.add_special_tokens,
            param="prompt" if len(prompts) == 1 else f"prompt[{i}]",
            keep_last=keep_last,
        )
        for i, p in enumerate(prompts)
    ]
    for ids in token_lists:
        check_context(ctx, len(ids), params.max_tokens, "max_tokens", params.min_tokens)
    ctx.limits.check_prompt_logprobs(params, [len(ids) for ids in token_lists])
    # A truncated prompt is echoed as what the model saw.
    texts: list[str | None] = [p if isinstance(p, str) and keep_last is None else None for p in prompts]
    return Admitted(model, params, token_lists, texts)


async def _admit_chat(ctx: ServingContext, body: ChatCompletionRequest) -> Admitted:
    model = ctx.check_model(body.model)
    # Checked before templating and tokenizing (max_tokens defaults to the room the prompt leaves).
    ctx.limits.check_chat(len(body.messages))
    engine = ctx.engine
    defaults = engine.processor.sampling_defaults
    asked_params = body.to_sampling_params(engine.max_model_len, defaults)
    check_params(ctx, asked_params, num_prompts=1, logprobs_param="top_logprobs")
    prompt = await render_chat_prompt(ctx, body.chat_messages(), body.add_generation_prompt)
    token_ids = await engine.tokenize_async(
        prompt,
        add_special_tokens=body.add_special_tokens,
        param="messages",
        keep_last=body.truncate_prompt_tokens,
    )
    asked = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    # Within the model's own cap, as completions checks it: what would be generated must fit.
    asked_tokens = defaults.cap(body.max_completion_tokens or body.max_tokens)
    check_context(ctx, len(token_ids), asked_tokens, asked, body.min_tokens)
    params = body.to_sampling_params(max(1, engine.max_model_len - len(token_ids)), defaults)
    return Admitted(model, params, [token_ids], [prompt])


async def admit_tokenize(
    ctx: ServingContext, body: TokenizeCompletionRequest | TokenizeChatRequest
) -> list[int]:
    """/tokenize: the text's token ids, counted even beyond the context (what a client asks it
    for), within --max-tokenize-chars."""
    ctx.check_model(body.model)
    if isinstance(body, TokenizeChatRequest):
        body.refuse_unsupported_extras()
        ctx.limits.check_chat(len(body.messages))
        text = await render_chat_prompt(ctx, template_messages(body.messages), body.add_generation_prompt)
        param = "messages"
    else:
        text, param = body.prompt, "prompt"
    return await ctx.engine.encode_async(text, body.add_special_tokens, param)


def admit_detokenize(ctx: ServingContext, body: DetokenizeRequest) -> list[int]:
    """/detokenize: token ids of the model's vocabulary."""
    ctx.check_model(body.model)
    ctx.engine.processor.check_token_ids(body.tokens, "tokens")
    return body.tokens


def check_params(
    ctx: ServingContext, params: SamplingParams, num_prompts: int, logprobs_param: str = "logprobs"
) -> None:
    """The request's caps and the model's bounds (token ids, logprobs), before any work."""
    ctx.limits.check(params, num_prompts, logprobs_param)
    ctx.engine.processor.check_params(params)


async def render_chat_prompt(
    ctx: ServingContext, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> str:
    """The conversation through the model's chat template; a template failure is a 400."""
    try:
        return await ctx.engine.render_chat_async(messages, add_generation_prompt)
    except Exception as exc:  # the template is user-facing Jinja: any failure is the request's fault
        raise RequestRefused(
            f"cannot apply the chat template: {exc}", HTTPStatus.BAD_REQUEST, param="messages"
        ) from exc


def check_context(
    ctx: ServingContext, prompt_tokens: int, max_tokens: int | None, param: str, min_tokens: int = 0
) -> None:
    """A completion must fit the context with its prompt: refused, never silently cut short.
    Without max_tokens it may take the room the prompt leaves, which must hold min_tokens."""
    limit = ctx.engine.max_model_len
    if max_tokens is None and prompt_tokens + min_tokens > limit:
        raise InvalidParameterError(
            "min_tokens",
            f"min_tokens must be in [0, max_tokens], got {min_tokens} (max_tokens: the "
            f"{max(limit - prompt_tokens, 0)} tokens the {prompt_tokens}-token prompt leaves of {limit})",
        )
    if max_tokens is not None and prompt_tokens + max_tokens > limit:
        raise RequestRefused(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for "
            f"the completion). Please reduce the prompt or {param}.",
            HTTPStatus.BAD_REQUEST,
            param=param,
            code=CONTEXT_LENGTH_EXCEEDED,  # what OpenAI's clients look for
        )


def check_room(ctx: ServingContext, num_sequences: int) -> None:
    """503 while the engine is down, or when these sequences would overfill the waiting room.

    The waiting room counts engine sequences (prompts x n); one request larger than the
    whole room is still admitted when the room is empty, or it could never run.
    """
    engine = ctx.engine
    problem = engine.health_problem()
    if problem is not None:  # dead, or alive but not serving (frozen, stuck): never queue behind it
        raise RequestRefused(
            f"the engine cannot serve now: {problem}",
            HTTPStatus.SERVICE_UNAVAILABLE,
            headers={"Retry-After": "5"},
        )
    limit = ctx.max_waiting_requests
    if limit is None and engine is not None:
        limit = ctx.max_waiting_requests = default_max_waiting_requests(engine)
    waiting = engine.num_waiting_requests
    if limit is not None and waiting > 0 and waiting + num_sequences > limit:
        raise RequestRefused(
            f"the server is overloaded: {waiting} sequences are waiting and this request adds "
            f"{num_sequences} (limit {limit}); retry later",
            HTTPStatus.SERVICE_UNAVAILABLE,
            headers={"Retry-After": "1"},
        )
