"""A request's KV block hashes as the engine computes them (core/kv_cache_manager's hash_block
and salt rule over the prompt's token ids), for the prefix index.

The prompt is tokenized as the server does it: completions' `prompt` (text or token ids) with
its add_special_tokens; a chat's messages through the model's chat template
(engine/processor.render_chat, the server's own function), then encoded. A body the schema
refuses, a template that fails or a prompt cut by truncate_prompt_tokens gives no hashes: the
request is routed on load, and the leader answers it (a 400 for a bad one)."""

from __future__ import annotations

import logging
from typing import Any

from tessera.core.kv_cache_manager import hash_block, root_hash
from tessera.engine.processor import encode_text, load_tokenizer, render_chat
from tessera.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from tessera.models.registry import resolve_tokenizer

logger = logging.getLogger("tessera.router")

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None) -> list[bytes]:
    """The chained hashes of the blocks the engine can hit: the full blocks before the prompt's
    last token (the engine always computes that one, KVCacheManager.get_computed_blocks)."""
    hashes = []
    parent = root_hash(cache_salt)
    for index in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


class PromptHasher:
    def __init__(self, model: str, block_size: int) -> None:
        self.tokenizer = load_tokenizer(resolve_tokenizer(model))  # once, at start-up; no weights
        self.block_size = block_size

    def prompt_token_ids(self, path: str, body: Any) -> list[int] | None:
        """The token ids the engine will see, or None when they cannot be known here."""
        try:
            if path == COMPLETIONS:
                completion = CompletionRequest.model_validate(body)
                prompts = completion.prompts()
                if completion.truncate_prompt_tokens is not None or not prompts:
                    return None
                prompt = prompts[0]  # several prompts: routed by the first
                if isinstance(prompt, list):
                    return prompt
                return encode_text(self.tokenizer, prompt, completion.add_special_tokens)
            if path == CHAT:
                chat = ChatCompletionRequest.model_validate(body)
                if chat.truncate_prompt_tokens is not None:
                    return None
                text = render_chat(self.tokenizer, chat.chat_messages(), chat.add_generation_prompt)
                return encode_text(self.tokenizer, text, chat.add_special_tokens, "messages")
        # The schema's refusal, a prompt that is not text, a user-facing Jinja template's failure:
        # all the request's own, which the leader answers.
        except Exception as exc:
            logger.debug("no prefix signal for a %s request: %s", path, exc)
        return None

    def hashes(self, path: str, body: Any) -> list[bytes]:
        token_ids = self.prompt_token_ids(path, body)
        if not token_ids:
            return []
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        return block_hashes(token_ids, self.block_size, salt if isinstance(salt, str) else None)
