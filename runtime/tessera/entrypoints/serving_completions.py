"""POST /v1/completions: text (or token-id) prompts, one or several, streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.engine.detokenizer import decode
from tessera.engine.output_processor import RequestOutputKind
from tessera.entrypoints.admission import admit
from tessera.entrypoints.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from tessera.entrypoints.serving_common import (
    ServingContext,
    cancel_on_disconnect,
    merge_streams,
    sse,
    sse_with_errors,
    streams_a_chunk,
)
from tessera.outputs import CompletionOutput, Logprob, RequestOutput
from tessera.sampling_params import SamplingParams


def completion_logprobs(
    output: CompletionOutput, text_offset: int, tokenizer: Any
) -> CompletionLogprobs | None:
    if output.logprobs is None:
        return None
    return logprobs_of_tokens(output.token_ids, output.logprobs, text_offset, tokenizer)


def prompt_logprobs(output: RequestOutput, tokenizer: Any) -> CompletionLogprobs | None:
    """The echoed prompt's part of `logprobs` (its first token has none: nothing comes before it)."""
    if output.prompt_logprobs is None:
        return None
    return logprobs_of_tokens(output.prompt_token_ids, output.prompt_logprobs, 0, tokenizer)


def logprobs_of_tokens(
    token_ids: list[int], entries: Sequence[dict[int, Logprob] | None], text_offset: int, tokenizer: Any
) -> CompletionLogprobs:
    def text_of(token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return str(tokenizer.decode([token_id]))

    result = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=False):
        own = entry.get(token_id) if entry is not None else None
        token = text_of(token_id, own)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if entry is None:  # a prompt's first token: nothing before it to condition on
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(max((own or Logprob(float("-inf"))).logprob, -9999.0))
        result.top_logprobs.append({text_of(tid, lp): max(lp.logprob, -9999.0) for tid, lp in entry.items()})
    return result


def echoed_choice(
    index: int,
    text: str,
    logprobs: CompletionLogprobs | None,
    completion: CompletionOutput | None,
    tokenizer: Any,
) -> CompletionChoice:
    """A choice of an echo request: the prompt (and its `logprobs`), then the completion unless the
    request only scores its prompt (`completion` None)."""
    if completion is None:
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason="length")
    generated = completion_logprobs(completion, len(text), tokenizer)
    if logprobs is not None and generated is not None:
        logprobs = logprobs + generated
    return CompletionChoice(
        index=index,
        text=text + completion.text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw_request: Request) -> Any:
    admitted = await admit(ctx, body)
    model, params, token_lists, texts = admitted.model, admitted.params, admitted.prompts, admitted.texts
    request_id = f"cmpl-{uuid.uuid4().hex}"
    if body.echo:  # token-id prompts are echoed as their text
        texts = [
            t if t is not None else decode(ctx.engine.tokenizer, ids)
            for t, ids in zip(texts, token_lists, strict=True)
        ]
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    generators = [
        ctx.engine.generate(f"{request_id}-{i}", ids, params, texts[i], kind, cache_salt=body.cache_salt)
        for i, ids in enumerate(token_lists)
    ]
    if body.stream:
        return StreamingResponse(
            sse_with_errors(_stream(ctx, body, params, model, request_id, generators, token_lists, texts)),
            media_type="text/event-stream",
        )
    finals = await cancel_on_disconnect(raw_request, _collect(generators))
    choices = []
    completion_tokens = 0
    tokenizer = ctx.engine.tokenizer
    for prompt_index, final in enumerate(finals):
        scored = prompt_logprobs(final, tokenizer)  # once per prompt, whatever n
        for output in sorted(final.outputs, key=lambda o: o.index):
            index = prompt_index * params.n + output.index
            if body.echo:
                shown = None if body.echo_only else output
                choices.append(echoed_choice(index, texts[prompt_index] or "", scored, shown, tokenizer))
                completion_tokens += len(shown.token_ids) if shown is not None else 0
                continue
            completion_tokens += len(output.token_ids)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=output.text,
                    logprobs=completion_logprobs(output, 0, tokenizer),
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                )
            )
    prompt_tokens = sum(len(ids) for ids in token_lists)
    usage = UsageInfo.of(prompt_tokens, completion_tokens)
    response = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(response.model_dump())


async def _collect(generators: list[AsyncGenerator[RequestOutput, None]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(generators)
    async for index, output in merge_streams(generators):
        finals[index] = output
    return [f for f in finals if f is not None]


async def _stream(
    ctx: ServingContext,
    body: CompletionRequest,
    params: SamplingParams,
    model: str,
    request_id: str,
    generators: list[AsyncGenerator[RequestOutput, None]],
    token_lists: list[list[int]],
    texts: list[str | None],
) -> AsyncIterator[str]:
    created = int(time.time())
    prompt_tokens = sum(len(ids) for ids in token_lists)
    completion_tokens = 0
    # Where each choice's next token's text starts: the echo, then every token's text so far (as
    # the non-streamed offsets count), not the text sent, which a possible stop string holds back.
    token_offsets: dict[int, int] = {}
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(choice: CompletionChoice) -> str:
        usage = UsageInfo.of(prompt_tokens, completion_tokens) if continuous else None
        return sse(
            CompletionResponse(id=request_id, created=created, model=model, choices=[choice], usage=usage)
        )

    tokenizer = ctx.engine.tokenizer

    def echo(prompt_index: int, output: RequestOutput | None) -> list[CompletionChoice]:
        text = texts[prompt_index] or ""
        logprobs = prompt_logprobs(output, tokenizer) if output is not None else None
        return [
            CompletionChoice(index=prompt_index * params.n + i, text=text, logprobs=logprobs)
            for i in range(params.n)
        ]

    # The echo comes first. With logprobs it waits for the prompt's, which come with the first
    # token: until then that prompt's choices are held back.
    awaiting_echo: set[int] = set()
    if body.echo:
        for prompt_index, text in enumerate(texts):
            for i in range(params.n):
                token_offsets[prompt_index * params.n + i] = len(text or "")
            if body.logprobs is None:
                for choice in echo(prompt_index, None):
                    yield chunk(choice)
            else:
                awaiting_echo.add(prompt_index)
    held: dict[int, list[CompletionChoice]] = {}
    async for prompt_index, output in merge_streams(generators):
        if prompt_index in awaiting_echo and output.prompt_logprobs is not None:
            awaiting_echo.discard(prompt_index)
            for choice in [*echo(prompt_index, output), *held.pop(prompt_index, [])]:
                yield chunk(choice)
        for completion in output.outputs:
            index = prompt_index * params.n + completion.index
            if body.echo_only:  # the one generated token is never shown
                if completion.finish_reason is None:
                    continue
                choice = CompletionChoice(index=index, text="", finish_reason="length")
            else:
                completion_tokens += len(completion.token_ids)
                if not streams_a_chunk(completion):
                    continue
                offset = token_offsets.get(index, 0)
                logprobs = completion_logprobs(completion, offset, tokenizer)
                if logprobs is not None:
                    token_offsets[index] = offset + sum(len(token) for token in logprobs.tokens)
                choice = CompletionChoice(
                    index=index,
                    text=completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            if prompt_index in awaiting_echo:
                held.setdefault(prompt_index, []).append(choice)
            else:
                yield chunk(choice)
    if body.stream_options is not None and body.stream_options.include_usage:
        usage = UsageInfo.of(prompt_tokens, completion_tokens)
        yield sse(CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage))
