"""Prompts in: tokenization, chat templates, validation, and fan-out of n samples."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.config import EngineConfig
from tessera.generation_config import SamplingDefaults, eos_token_ids, load_sampling_defaults
from tessera.models.hf_config import load_hf_config
from tessera.sampling_params import InvalidParameterError, SamplingParams
from tessera.wire.messages import EngineCoreRequest

if TYPE_CHECKING:  # only a type: transformers takes seconds to import, so it loads with the tokenizer
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    # Imported here: AsyncLLM loads the tokenizer on a thread while the engine core process
    # starts, so transformers' 3.5 s of imports overlap the model's load instead of preceding it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """The conversation as the model's chat template renders it (the server's and the router's)."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert isinstance(text, str)
    return text


def encode_text(
    tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True, param: str = "prompt"
) -> list[int]:
    """Token ids of any text, as the server tokenizes a prompt (the router hashes the same ids)."""
    try:
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
    except (UnicodeError, TypeError) as exc:  # e.g. a lone UTF-16 surrogate
        raise InvalidParameterError(param, f"{param} is not valid Unicode text") from exc


# OpenAI's error code for a prompt (and completion) longer than the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def model_vocab_size(model_dir: Path) -> int:
    """Rows of the embedding and columns of the logits: every token id must be below it."""
    return int(load_hf_config(model_dir).vocab_size)


def max_prompt_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The longest prompt the engine can ever schedule (one token of room to generate)."""
    longest = max_model_len - 1
    if not config.enable_chunked_prefill:
        longest = min(longest, config.max_num_batched_tokens)  # a prompt must fit in one step
    return longest


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_model_len: int,
        eos_token_id: int | None = None,
        extra_eos_token_ids: list[int] | None = None,
        vocab_size: int | None = None,
        max_prompt_len: int | None = None,
        sampling_defaults: SamplingDefaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # What a request leaves unset samples as the model asks (its generation_config.json).
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.max_model_len = max_model_len
        self.max_prompt_len = max_model_len - 1 if max_prompt_len is None else max_prompt_len
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.extra_eos_token_ids = [t for t in (extra_eos_token_ids or []) if t != self.eos_token_id]
        self.vocab_size = len(tokenizer) if vocab_size is None else vocab_size
        # No token decodes to more characters than its vocabulary entry has (one per byte for
        # byte-level BPE), so longer text cannot fit: refused without spending time tokenizing it.
        longest_token = max((len(token) for token in tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = self.max_prompt_len * max(1, longest_token)
        # Any text tokenized at all (/tokenize, a prompt cut by truncate_prompt_tokens): a few
        # contexts' worth, so no request can hold the tokenizer for seconds (serve's
        # --max-tokenize-chars sets it).
        self.max_tokenize_chars = 4 * self.max_prompt_chars

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        max_model_len: int,
        config: EngineConfig | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> InputProcessor:
        """Everything from the model's folder (the tokenizer too unless given) and ``config``."""
        return cls(
            load_tokenizer(model_dir) if tokenizer is None else tokenizer,
            max_model_len,
            extra_eos_token_ids=eos_token_ids(model_dir),
            vocab_size=model_vocab_size(model_dir),
            max_prompt_len=None if config is None else max_prompt_tokens(config, max_model_len),
            sampling_defaults=None
            if config is None
            else load_sampling_defaults(
                model_dir, config.generation_config, config.override_generation_config
            ),
        )

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)

    def tokenize(
        self,
        prompt: str | list[int],
        add_special_tokens: bool = True,
        param: str = "prompt",
        keep_last: int | None = None,
    ) -> list[int]:
        """Token ids of a prompt; InvalidParameterError for an empty, invalid or over-long one.
        ``keep_last`` (vLLM's truncate_prompt_tokens): only its last tokens, however long it was;
        -1: as many as a prompt may have."""
        if keep_last == -1:
            keep_last = self.max_prompt_len
        if isinstance(prompt, str):
            self.check_text_length(prompt, param, truncated=keep_last is not None)
            token_ids = self.encode(prompt, add_special_tokens, param)
        else:
            token_ids = list(prompt)
            self.check_token_ids(token_ids, param)
        if keep_last is not None:
            token_ids = token_ids[-keep_last:] if keep_last > 0 else []
        if not token_ids:
            raise InvalidParameterError(param, f"{param} is empty")
        if len(token_ids) > self.max_prompt_len:
            raise InvalidParameterError(
                param, self._too_long_message(len(token_ids), param), code=CONTEXT_LENGTH_EXCEEDED
            )
        return token_ids

    def check_text_length(self, text: str, param: str = "prompt", truncated: bool = True) -> None:
        """Refuse, before any tokenizing, a text too long to tokenize: one that is not truncated
        must fit the context (max_prompt_chars); any text at all, max_tokenize_chars."""
        if not truncated and len(text) > self.max_prompt_chars:
            raise InvalidParameterError(
                param,
                f"{param} has {len(text)} characters, more than fit in the {self.max_prompt_len} "
                f"tokens a prompt may have (this model's maximum context length is {self.max_model_len})",
                code=CONTEXT_LENGTH_EXCEEDED,
            )
        if len(text) > self.max_tokenize_chars:
            raise InvalidParameterError(
                param,
                f"{param} has {len(text)} characters; at most {self.max_tokenize_chars} are tokenized "
                "per text (--max-tokenize-chars)",
            )

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        """Token ids of any text, whatever its length (/tokenize counts what may not fit)."""
        return encode_text(self.tokenizer, text, add_special_tokens, param)

    def _too_long_message(self, num_tokens: int, param: str) -> str:
        if self.max_prompt_len < self.max_model_len - 1:
            return (
                f"{param} has {num_tokens} tokens, but with chunked prefill off a prompt must fit in "
                f"one step of max_num_batched_tokens={self.max_prompt_len} tokens"
            )
        return (
            f"{param} has {num_tokens} tokens, but this model's maximum context length is "
            f"{self.max_model_len} (prompt plus at least one generated token)"
        )

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Every id must index the model's vocabulary (an unchecked one reaches a tensor index)."""
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidParameterError(
                param, f"{param} must hold token ids in [0, {self.vocab_size}), got {bad[:5]}"
            )

    def check_params(self, params: SamplingParams) -> None:
        """What only the model can judge: token ids against its vocabulary."""
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if params.allowed_token_ids:
            self.check_token_ids(params.allowed_token_ids, "allowed_token_ids")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidParameterError(
                "logprobs", f"logprobs must be at most the vocabulary size {self.vocab_size}"
            )

    def check_request(self, params: SamplingParams, cache_salt: str | None = None) -> None:
        """The offline API's admission (the server's schema checks the salt): what the model can
        judge, and the cache salt."""
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidParameterError("cache_salt", "cache_salt must be a non-empty string if provided")
        self.check_params(params)

    def process(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per sample: n>1 fans out to children with derived seeds.

        The request was admitted already: by the API server's admit() (entrypoints/admission.py),
        by the offline LLM through check_request."""
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=params.stop_token_ids + self.extra_eos_token_ids)
        arrival = time.time() if arrival_time is None else arrival_time
        return [
            EngineCoreRequest(
                request_id=child_request_id(request_id, index, params.n),
                prompt_token_ids=prompt_token_ids,
                sampling_params=params.for_child(index) if params.n > 1 else params,
                eos_token_id=self.eos_token_id,
                arrival_time=arrival,
                cache_salt=cache_salt,
            )
            for index in range(params.n)
        ]
