"""vLLM's /tokenize and /detokenize: what a prompt costs in tokens before it is sent, and back.

Unlike a completion, /tokenize counts a prompt longer than the context too: that is what a
client asks it for.
"""

from __future__ import annotations

from tessera.engine.detokenizer import decode
from tessera.entrypoints.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    template_messages,
)
from tessera.entrypoints.serving_chat import render_chat_prompt
from tessera.entrypoints.serving_common import ServingContext


async def tokenize(
    ctx: ServingContext, body: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    ctx.check_model(body.model)
    engine = ctx.engine
    if isinstance(body, TokenizeChatRequest):
        body.refuse_unsupported_extras()
        ctx.limits.check_chat(len(body.messages))
        text = await render_chat_prompt(ctx, template_messages(body.messages), body.add_generation_prompt)
        param = "messages"
    else:
        text, param = body.prompt, "prompt"
    tokens = await engine.encode_async(text, body.add_special_tokens, param)
    strings = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strings
    )


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    ctx.check_model(body.model)
    ctx.engine.processor.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=decode(ctx.engine.tokenizer, body.tokens))
