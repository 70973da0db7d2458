"""Per-request caps of `tessera serve`: flags, defaults, and their checks (admission.py runs them).

The model's own bounds (vocabulary, context length) are the InputProcessor's; these are the
operator's choices of how much one request may ask for, so one client cannot swamp the server.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, fields

from tessera.engine.arg_utils import parse_size
from tessera.sampling_params import MAX_LOGPROBS, MAX_N, InvalidParameterError, SamplingParams


@dataclass(frozen=True)
class ServingLimits:
    max_request_body_size: int = 8 * 1024**2
    max_json_depth: int = 32
    max_n: int = MAX_N
    max_prompts_per_request: int = 128
    max_sequences_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_string_length: int = 512
    max_stop_token_ids: int = 1024
    max_logprobs: int = MAX_LOGPROBS
    max_chat_messages: int = 4096
    # prompts x scored positions x (logprobs + 1) x n: one entry is about 200 bytes in the API
    # process (a Logprob, its decoded token, its JSON), so the default holds a request near 200 MiB.
    max_prompt_logprobs_entries: int = 1 << 20
    # None: 4 x the characters a full context can hold (InputProcessor.max_prompt_chars).
    max_tokenize_chars: int | None = None
    max_stream_backlog: int = 1024

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServingLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def check(self, params: SamplingParams, num_prompts: int, logprobs_param: str = "logprobs") -> None:
        """InvalidParameterError naming the first parameter over its cap."""
        if num_prompts > self.max_prompts_per_request:
            raise InvalidParameterError(
                "prompt", f"at most {self.max_prompts_per_request} prompts per request, got {num_prompts}"
            )
        if params.n > self.max_n:
            raise InvalidParameterError("n", f"n must be at most {self.max_n}, got {params.n}")
        if params.n * num_prompts > self.max_sequences_per_request:
            raise InvalidParameterError(
                "n",
                f"n x prompts is {params.n * num_prompts} sequences; at most "
                f"{self.max_sequences_per_request} per request",
            )
        if len(params.stop) > self.max_stop_strings:
            raise InvalidParameterError(
                "stop", f"at most {self.max_stop_strings} stop strings, got {len(params.stop)}"
            )
        if any(len(stop) > self.max_stop_string_length for stop in params.stop):
            raise InvalidParameterError(
                "stop", f"a stop string may have at most {self.max_stop_string_length} characters"
            )
        if len(params.stop_token_ids) > self.max_stop_token_ids:
            raise InvalidParameterError(
                "stop_token_ids",
                f"at most {self.max_stop_token_ids} stop token ids, got {len(params.stop_token_ids)}",
            )
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise InvalidParameterError(
                logprobs_param, f"{logprobs_param} must be at most {self.max_logprobs}, got {params.logprobs}"
            )

    def check_prompt_logprobs(self, params: SamplingParams, prompt_lengths: list[int]) -> None:
        """Echo with logprobs scores every prompt position: the answer holds prompts x positions x
        (logprobs + 1) entries, once per choice (n). Refused before the engine does any work."""
        if params.prompt_logprobs is None:
            return
        entries = sum(prompt_lengths) * (params.prompt_logprobs + 1) * params.n
        if entries > self.max_prompt_logprobs_entries:
            raise InvalidParameterError(
                "logprobs",
                f"echo with logprobs would score {entries} prompt logprob entries (prompt tokens x "
                f"(logprobs + 1) x n = {sum(prompt_lengths)} x {params.prompt_logprobs + 1} x {params.n}); "
                f"the cap is {self.max_prompt_logprobs_entries} (--max-prompt-logprobs-entries): "
                "send fewer or shorter prompts, or fewer logprobs",
            )

    def check_chat(self, num_messages: int) -> None:
        if num_messages > self.max_chat_messages:
            raise InvalidParameterError(
                "messages", f"at most {self.max_chat_messages} messages per request, got {num_messages}"
            )


_HELP = {
    "max_request_body_size": "largest request body, checked before parsing (bytes, or 8MiB, 1GB, ...)",
    "max_json_depth": "deepest nesting of arrays and objects in a request body",
    "max_n": f"largest n (samples per prompt), at most {MAX_N}",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "max_sequences_per_request": "most sequences (prompts x n) one request may start",
    "max_stop_strings": "most stop strings per request",
    "max_stop_string_length": "longest stop string, in characters",
    "max_stop_token_ids": "most stop token ids per request",
    "max_logprobs": f"largest logprobs / top_logprobs, at most {MAX_LOGPROBS} (as vLLM's --max-logprobs)",
    "max_chat_messages": "most messages in one /v1/chat/completions request",
    "max_prompt_logprobs_entries": "most prompt logprob entries one echo request may ask for, counted as "
    "prompt tokens x (logprobs + 1) x n (each is about 200 bytes of the server's memory); 400 beyond",
    "max_stream_backlog": "most outputs a stream may leave unread (a client not reading it); beyond, its "
    "request is aborted (its KV blocks freed) and the stream ends with an error",
    "max_tokenize_chars": "longest text any path tokenizes (/tokenize, prompts with truncate_prompt_tokens, "
    "chat and completion prompts), in characters; a prompt that is not truncated must also fit the "
    "context. Default: 4 x the characters a full context can hold",
}


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (each request is checked at the door; 4xx beyond)")
    for field in fields(ServingLimits):
        group.add_argument(
            "--" + field.name.replace("_", "-"),
            type=_TYPES.get(field.name, _positive_int),
            default=field.default,
            help=_HELP[field.name]
            if field.default is None
            else f"{_HELP[field.name]} (default: {field.default})",
        )


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from exc
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high or 'inf'}], got {value}")
        return value

    return parse


_positive_int = _int_in(1)
_TYPES: dict[str, Callable[[str], int]] = {
    "max_request_body_size": parse_size,
    "max_logprobs": _int_in(0, MAX_LOGPROBS),
    "max_n": _int_in(1, MAX_N),
}
