"""Messages between the frontend (LLM / AsyncLLM) and the engine core.

Plain dataclasses of builtin types, so they serialize compactly with msgpack
(no pickle of arbitrary objects) when the engine core runs in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.sampling_params import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
# The engine core could not serve this one request (see EngineCoreOutput.error); others go on.
FINISH_ERROR = "error"


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # always n=1 here: the frontend fans n>1 out
    eos_token_id: int | None
    arrival_time: float
    # Mixed into the first KV block's hash: only requests with the same salt share cached
    # prefixes (vLLM's cache_salt), so one tenant cannot time another's prompts out of the cache.
    cache_salt: str | None = None


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token: its own, and the top-k alternatives (ids and logprobs)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0  # of its own token among the whole vocabulary (1 = most likely; 0: not computed)


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `first_position`, `first_position + 1`, ... (each given the tokens
    before it): one step's chunk of a prompt, or the whole prompt (from position 1) in an output."""

    first_position: int
    entries: list[TokenLogprobs]


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # With the first output of a request that asked for them: every prompt token's after the first.
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT | FINISH_ERROR
    stop_reason: int | str | None = None  # the stop token id (or stop string, set by the detokenizer)
    num_cached_tokens: int = 0
    first_scheduled_time: float = 0.0  # wall clock when the request left the waiting queue
    error: str | None = None  # with FINISH_ERROR: a short reason for the client (no traceback, no paths)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up since the last stats (delta)
    prefix_cache_hits: int = 0  # tokens found since the last stats (delta)
    num_preemptions: int = 0  # since the last stats (delta)


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0


@dataclass
class EngineCoreHeartbeat:
    """Sent by the engine core about once a second, so the frontend can tell a live core from a deaf or stuck one."""

    input_alive: bool  # the thread that receives requests is running
    stalled_s: float  # how long the busy loop has been inside one iteration with work pending (0 when idle)
    protocol_errors: int  # malformed messages received and dropped since start
