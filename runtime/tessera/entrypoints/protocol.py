"""OpenAI API schemas (pydantic), with vLLM's extra sampling fields.

Every bound the engine relies on is declared here, so bad input is a 400 at the door and
never an error deep in the engine (ints must fit msgpack; floats must be finite).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tessera.generation_config import SamplingDefaults
from tessera.sampling_params import MAX_LOGPROBS, MAX_N, InvalidParameterError, SamplingParams

INT32 = 2**31 - 1
MAX_LOGIT_BIAS_TOKENS = 1024  # entries in one request's logit_bias
INT64 = 2**63 - 1


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (the OpenAI SDK grows new ones); NaN/inf are rejected.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    """JSON may carry a lone UTF-16 surrogate ("\\ud800"); such text has no UTF-8 encoding."""
    if isinstance(value, str):
        return not value.isascii() and _LONE_SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(_has_lone_surrogate(k) or _has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list) and value and not isinstance(value[0], int):  # token ids hold no text
        return any(_has_lone_surrogate(item) for item in value)
    return False


class RequestModel(OpenAIModel):
    """A model of request input: all its text must be valid Unicode (tokenizers and JSON need it).

    An explicit null means the default, as in OpenAI's API (its SDKs send `None` as null), except
    for the fields in `null_kept`, where vLLM gives null a meaning of its own."""

    null_kept: ClassVar[frozenset[str]] = frozenset()
    # Declared fields Tessera does not implement, each with the value that asks for nothing.
    unsupported_extras: ClassVar[dict[str, Any]] = {}

    def refuse_unsupported_extras(self) -> None:
        """A 400 naming the first extra asked for: a client would otherwise trust an effect that
        never happened. An empty object or list asks for nothing, as null does."""
        for name, harmless in self.unsupported_extras.items():
            value = getattr(self, name)
            if value is None or value == harmless or (isinstance(value, dict | list) and not value):
                continue
            hint = " (completions: echo with logprobs scores the prompt)" if name == "prompt_logprobs" else ""
            raise InvalidParameterError(name, f"{name} is not supported{hint}")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None or key in cls.null_kept}
        return data

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        if _has_lone_surrogate(value):
            raise ValueError("text must be valid Unicode (it holds a lone UTF-16 surrogate)")
        return value


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tessera"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=INT32)]], Field(min_length=1)]


# vLLM's extras that Tessera does not implement, each with the value that asks for nothing: any
# other value is refused with a 400 naming the field (a client would otherwise trust an effect
# that never happened: constrained output, beam search, a truncated prompt).
UNSUPPORTED_VLLM_EXTRAS: dict[str, Any] = {
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "bad_words": None,
    "logits_processors": None,
    "prompt_logprobs": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "priority": 0,
    "return_tokens_as_token_ids": False,
    "return_token_ids": False,
    "spaces_between_special_tokens": True,
    "truncation_side": None,
}
# What a chat's template would be given (vLLM's): the model's own template renders it as is.
UNSUPPORTED_TEMPLATE_EXTRAS: dict[str, Any] = {
    "continue_final_message": False,
    "chat_template": None,
    "chat_template_kwargs": None,
    "documents": None,
}
UNSUPPORTED_CHAT_EXTRAS: dict[str, Any] = {"echo": False, **UNSUPPORTED_TEMPLATE_EXTRAS}


class SamplingFields(RequestModel):
    """Fields both endpoints share; `to_sampling_params` turns them into the engine's SamplingParams."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=1e4)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-INT64, le=INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra parameters.
    top_k: int | None = Field(None, ge=-1, le=INT32)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=1e4)
    min_tokens: int = Field(0, ge=0, le=INT32)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # OpenAI's: token ids (as strings, JSON's keys) to a bias in [-100, 100] added to their logits.
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_TOKENS)
    # vLLM's: only the prompt's last k tokens are used (-1: as many as a prompt may have).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT32)
    # vLLM's: only these token ids may be sampled.
    allowed_token_ids: list[Annotated[int, Field(ge=0, le=INT32)]] | None = Field(None, min_length=1)
    # vLLM's: only requests with the same salt share prefix-cache blocks (a tenant's secret).
    cache_salt: str | None = Field(None, min_length=1)
    # Structured output (both endpoints in vLLM): refused below unless plain text.
    response_format: dict[str, Any] | None = None
    # UNSUPPORTED_VLLM_EXTRAS, declared so that asking for them is refused, never ignored.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    priority: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    spaces_between_special_tokens: Any = None
    truncation_side: Any = None
    unsupported_extras: ClassVar[dict[str, Any]] = UNSUPPORTED_VLLM_EXTRAS

    def _token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            if not (key.strip().isascii() and key.strip().isdigit()):
                raise InvalidParameterError("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
            biases[int(key)] = bias
        return biases

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: SamplingDefaults
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options", "stream_options can only be given with stream=true")
        self.refuse_unsupported_extras()
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            kind = self.response_format.get("type")
            raise InvalidParameterError(
                "response_format", f"response_format {kind!r} is not supported (text is)"
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def unless_set(name: str, engine_default: float) -> Any:
            """The request's value, else the model's default, else the engine's (vLLM's order)."""
            for value in (getattr(self, name), getattr(defaults, name)):
                if value is not None:
                    return value
            return engine_default

        return SamplingParams(
            n=self.n,
            temperature=unless_set("temperature", 1.0),
            top_p=unless_set("top_p", 1.0),
            top_k=unless_set("top_k", 0),
            min_p=unless_set("min_p", 0.0),
            seed=self.seed,
            max_tokens=defaults.cap(max_tokens),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=unless_set("repetition_penalty", 1.0),
            logit_bias=self._token_biases(),
            allowed_token_ids=self.allowed_token_ids,
            skip_special_tokens=self.skip_special_tokens,
        )


# --- /v1/completions -------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    # Left out: 16 (OpenAI's and vLLM's default); null: as many as the context leaves (vLLM's).
    null_kept: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    prompt: str | list[str] | TokenIds | list[TokenIds]
    # vLLM's: whether the tokenizer adds its special tokens (BOS) to a text prompt.
    add_special_tokens: bool = True
    max_tokens: int | None = Field(16, ge=0, le=INT32)  # 0: with echo, score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and by --max-logprobs
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt must hold at least one prompt")
        return prompt

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self, defaults: SamplingDefaults) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", "best_of is not supported (it must equal n when given)")
        if self.suffix:
            raise InvalidParameterError("suffix", "suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidParameterError("max_tokens", "max_tokens must be >= 1 (0 only with echo)")
        # With echo, logprobs cover the prompt too; max_tokens 0 generates one token, never shown.
        params = self._sampling_params(
            max(self.max_tokens, 1) if self.echo and self.max_tokens is not None else self.max_tokens,
            self.logprobs,
            defaults,
        )
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params

    @property
    def echo_only(self) -> bool:
        """Prompt scoring (echo, max_tokens 0): the answer is the prompt, with its logprobs if asked."""
        return self.echo and self.max_tokens == 0


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            text_offset=self.text_offset + other.text_offset,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            tokens=self.tokens + other.tokens,
            top_logprobs=self.top_logprobs + other.top_logprobs,
        )


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# --- /v1/chat/completions ----------------------------------------------------------------


# Content part types that hold text, and the field holding it: OpenAI's chat parts, an
# assistant's refusal (an SDK replaying a conversation sends it back), the Responses API's.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ContentPart(RequestModel):
    """One part of a message's content; only text parts can be served (the models read text)."""

    type: str
    text: str | None = None
    refusal: str | None = None

    def part_text(self) -> str | None:
        field = TEXT_PARTS.get(self.type)
        return None if field is None else getattr(self, field)


class ChatMessage(RequestModel):
    # OpenAI's roles, its deprecated `function` among them, and Llama 3's `ipython` (vLLM's too).
    role: Literal["system", "developer", "user", "assistant", "tool", "function", "ipython"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A conversation's tool-call history: the chat template renders it (vLLM passes both on).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = [text for part in self.content if (text := part.part_text()) is not None]
        if len(texts) < len(self.content):
            kinds = sorted(
                {part.type for part in self.content if part.type not in TEXT_PARTS} or {"text without text"}
            )
            raise InvalidParameterError("messages", f"content part type {kinds[0]!r} is not supported")
        return "\n".join(texts)  # vLLM joins text parts by line


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and by --max-logprobs
    add_generation_prompt: bool = True
    # vLLM's: off, since the chat template already holds the special tokens (BOS) it wants.
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    # Declared so that asking for them is refused (below), never silently ignored.
    echo: Any = None
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    unsupported_extras: ClassVar[dict[str, Any]] = UNSUPPORTED_VLLM_EXTRAS | UNSUPPORTED_CHAT_EXTRAS
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    def to_sampling_params(self, default_max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
        if self.tools:
            raise InvalidParameterError("tools", "tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise InvalidParameterError("tool_choice", "tool_choice needs tools, which are not supported")
        for name in ("functions", "function_call", "audio", "prediction"):
            if getattr(self, name):
                raise InvalidParameterError(name, f"{name} is not supported")
        if self.modalities is not None and set(self.modalities) != {"text"}:
            raise InvalidParameterError("modalities", "only the text modality is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs", "top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)

    def chat_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(chat: list[ChatMessage]) -> list[dict[str, Any]]:
    """What the chat template sees: each message's role and text, and its name and tool-call
    history when given (templates render them, as vLLM passes them on)."""
    messages = []
    for index, m in enumerate(chat):
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls is not None:
            message["tool_calls"] = [
                _with_parsed_arguments(call, f"messages[{index}].tool_calls[{i}]")
                for i, call in enumerate(m.tool_calls)
            ]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def _with_parsed_arguments(call: dict[str, Any], param: str) -> dict[str, Any]:
    """A tool call whose function arguments (a JSON string on the wire) are an object, as chat
    templates iterate them (vLLM parses them the same way)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as exc:
        raise InvalidParameterError(param, f"{param}.function.arguments is not JSON: {exc}") from exc
    return {**call, "function": {**function, "arguments": arguments}}


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIModel):
    # Only a choice's first delta names the role; OpenAI's later deltas have no role key at all.
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda role: role is None)
    content: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# --- /tokenize and /detokenize (vLLM's) -----------------------------------------------------


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template already holds the special tokens it wants
    return_token_strs: bool = False
    # Declared so that asking for them is refused, never a count of another prompt than asked.
    continue_final_message: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    tools: Any = None
    unsupported_extras: ClassVar[dict[str, Any]] = UNSUPPORTED_TEMPLATE_EXTRAS | {"tools": None}


def _tokenize_form(body: Any) -> str:
    """A body with messages is the chat form: its mistakes are reported as the chat form's, not as
    the prompt form's missing prompt. A null `messages` is no messages, as null is the default."""
    chat = (isinstance(body, dict) and body.get("messages") is not None) or isinstance(
        body, TokenizeChatRequest
    )
    return "TokenizeChatRequest" if chat else "TokenizeCompletionRequest"


# Tags are class names: not lower-case, so an error's `param` leaves them out.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_form),
]


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: TokenIds


class DetokenizeResponse(OpenAIModel):
    prompt: str
