"""POST /v1/chat/completions: the tokenizer's chat template, then the same engine path as completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tessera.engine.output_processor import RequestOutputKind
from tessera.engine.token_bytes import TokenBytes
from tessera.entrypoints.admission import admit
from tessera.entrypoints.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from tessera.entrypoints.serving_common import (
    ServingContext,
    cancel_on_disconnect,
    sse,
    sse_with_errors,
    streams_a_chunk,
)
from tessera.outputs import CompletionOutput, Logprob, RequestOutput


def chat_logprobs(output: CompletionOutput, top_n: int, token_bytes: TokenBytes) -> ChatLogprobs | None:
    if output.logprobs is None:
        return None

    def entry_of(token_id: int, lp: Logprob) -> TopLogprob:
        token = lp.decoded_token if lp.decoded_token is not None else token_bytes.tokenizer.decode([token_id])
        return TopLogprob(token=token, logprob=max(lp.logprob, -9999.0), bytes=token_bytes(token_id, token))

    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=False):
        sampled = entry_of(token_id, entry.get(token_id) or Logprob(float("-inf")))
        ranked = sorted(
            ((lp.rank, tid, lp) for tid, lp in entry.items() if lp.rank is not None), key=lambda x: x[0]
        )
        top = [entry_of(tid, lp) for _, tid, lp in ranked[:top_n]]
        content.append(TokenLogprob(**sampled.model_dump(), top_logprobs=top))
    return ChatLogprobs(content=content)


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, raw_request: Request
) -> Any:
    admitted = await admit(ctx, body)
    model, params, token_ids, prompt = admitted.model, admitted.params, admitted.prompts[0], admitted.texts[0]
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
    generator = ctx.engine.generate(request_id, token_ids, params, prompt, kind, cache_salt=body.cache_salt)
    top_n = body.top_logprobs or 0
    if body.stream:
        return StreamingResponse(
            sse_with_errors(_stream(ctx, body, model, request_id, generator, len(token_ids), top_n)),
            media_type="text/event-stream",
        )
    final = await cancel_on_disconnect(raw_request, _last(generator))
    choices = [
        ChatChoice(
            index=output.index,
            message=ChatResponseMessage(content=output.text),
            logprobs=chat_logprobs(output, top_n, ctx.engine.token_bytes),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )
        for output in sorted(final.outputs, key=lambda o: o.index)
    ]
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    usage = UsageInfo.of(len(token_ids), completion_tokens)
    return JSONResponse(
        ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage).model_dump()
    )


async def _last(generator: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    final = None
    try:
        async for output in generator:
            final = output
    finally:
        await generator.aclose()
    assert final is not None
    return final


async def _stream(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    model: str,
    request_id: str,
    generator: AsyncGenerator[RequestOutput, None],
    num_prompt_tokens: int,
    top_n: int,
) -> AsyncIterator[str]:
    created = int(time.time())
    completion_tokens = 0
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats

    def chunk(choice: ChatStreamChoice) -> str:
        usage = UsageInfo.of(num_prompt_tokens, completion_tokens) if continuous else None
        return sse(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice], usage=usage)
        )

    try:
        for index in range(body.n):
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
        async for output in generator:
            for completion in output.outputs:
                completion_tokens += len(completion.token_ids)
                if not streams_a_chunk(completion):
                    continue
                yield chunk(
                    ChatStreamChoice(
                        index=completion.index,
                        delta=DeltaMessage(content=completion.text),
                        logprobs=chat_logprobs(completion, top_n, ctx.engine.token_bytes),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = UsageInfo.of(num_prompt_tokens, completion_tokens)
            yield sse(
                ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage)
            )
    finally:
        await generator.aclose()
