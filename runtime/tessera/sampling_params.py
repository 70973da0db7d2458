"""Per-request sampling parameters, shaped like vLLM's so its users feel at home."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MAX_LOGPROBS = 20  # top logprobs per token the engine returns at most (vLLM's default cap)
MAX_N = 128  # samples per prompt one request may ask for (the API's schema bound)


class RequestRefused(ValueError):
    """A request the server will not run, as its client is told: the message, the HTTP status,
    the parameter at fault (`param`), OpenAI's machine-readable `code` (e.g.
    context_length_exceeded; the status when None) and any headers (Retry-After).

    The one error of admission (entrypoints/admission.py); the API server renders it as OpenAI's
    error body. Here, at the bottom, so every layer that judges a request can raise it."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers
        self.code = code


class InvalidParameterError(RequestRefused):
    """A request parameter out of bounds (400); `param` names it for the client."""

    param: str

    def __init__(self, param: str, message: str, code: str | None = None) -> None:
        super().__init__(message, 400, param, code=code)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    prompt_logprobs: int | None = None  # number of top logprobs per prompt token (after the first)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    allowed_token_ids: list[int] | None = None  # when set, only these may be sampled

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> None:  # every message starts with its parameter's name
            raise InvalidParameterError(message.split(" ", 1)[0], message)

        # NaN passes every comparison below as if in range, and sampling then draws garbage.
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
        for name in ("min_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                fail(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if self.temperature < 0.0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            fail(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail(f"seed must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**64 - self.n:
            fail(f"seed must be in [-2^63, 2^64 - n] (each of n samples seeds a generator), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                fail("allowed_token_ids must be a non-empty list of token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids):
                fail("allowed_token_ids must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail("logit_bias must map token ids to biases")
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    fail(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
                if isinstance(bias, bool) or not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                    fail(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def for_child(self, index: int) -> SamplingParams:
        """The parameters of one of n samples: n=1, a distinct derived seed when seeded; the prompt's
        logprobs are the same for all, so only the first computes them."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs if index == 0 else None)
