"""A request as the engine core sees it: token ids, progress, and status."""

from __future__ import annotations

import enum

from tessera.sampling_params import SamplingParams
from tessera.wire.messages import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineCoreRequest,
    TokenLogprobs,
)


class RequestRejected(ValueError):
    """The engine core cannot take this request; it fails alone, the engine keeps serving."""


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FINISH_STOP,
    RequestStatus.FINISHED_LENGTH: FINISH_LENGTH,
    RequestStatus.FINISHED_ABORTED: FINISH_ABORT,
    RequestStatus.FINISHED_ERROR: FINISH_ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Tokens whose KV is computed, or scheduled to be: advanced at schedule time, so a
        # request whose every token is in flight is not scheduled again until its output arrives.
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until then
        self.first_scheduled_time = 0.0  # wall clock of the first schedule: queue time ends there
        self.num_preemptions = 0
        self.incarnation = -1  # set by the scheduler when added, and again at each preemption
        # Workers hold per-request state; it is sent again after a preemption dropped it.
        self.known_to_workers = False
        # Hashes of this request's full blocks, computed once and extended as it grows.
        self.block_hashes: list[bytes] = []
        # Prompt logprobs by position, gathered chunk by chunk until the first output carries them.
        self.prompt_logprobs: dict[int, TokenLogprobs] = {}
        self.prompt_logprobs_sent = False

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        check_request_fields(request)
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_id,
            request.arrival_time,
            request.cache_salt,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.finished


def check_request_fields(request: EngineCoreRequest) -> None:
    """The wire carries any msgpack value in any field: refuse what the engine cannot use."""

    def is_token_id(value: object) -> bool:
        return type(value) is int and value >= 0

    if type(request.request_id) is not str or not request.request_id:
        raise RequestRejected("request_id must be a non-empty string")
    if type(request.prompt_token_ids) is not list or not request.prompt_token_ids:
        raise RequestRejected("the prompt must hold at least one token")
    if not all(is_token_id(token) for token in request.prompt_token_ids):
        raise RequestRejected("prompt token ids must be non-negative integers")
    if not isinstance(request.sampling_params, SamplingParams):
        raise RequestRejected("sampling_params are missing")
    if request.eos_token_id is not None and not is_token_id(request.eos_token_id):
        raise RequestRejected("eos_token_id must be a non-negative integer")
    if type(request.arrival_time) not in (int, float):
        raise RequestRejected("arrival_time must be a number")
    if request.cache_salt is not None and (type(request.cache_salt) is not str or not request.cache_salt):
        raise RequestRejected("cache_salt must be a non-empty string")
