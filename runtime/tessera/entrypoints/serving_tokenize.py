"""vLLM's /tokenize and /detokenize: what a prompt costs in tokens before it is sent, and back.

Unlike a completion, /tokenize counts a prompt longer than the context too: that is what a
client asks it for.
"""

from __future__ import annotations

from tessera.engine.detokenizer import decode
from tessera.entrypoints.admission import admit_detokenize, admit_tokenize
from tessera.entrypoints.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from tessera.entrypoints.serving_common import ServingContext


async def tokenize(
    ctx: ServingContext, body: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    engine = ctx.engine
    tokens = await admit_tokenize(ctx, body)
    strings = engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=strings
    )


async def detokenize(ctx: ServingContext, body: DetokenizeRequest) -> DetokenizeResponse:
    tokens = admit_detokenize(ctx, body)
    return DetokenizeResponse(prompt=decode(ctx.engine.tokenizer, tokens))
