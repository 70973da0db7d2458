"""What the scheduler hands to every worker each step, and what the last stage hands back.

Builtin types only: the same objects are broadcast to worker processes and pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.sampling_params import SamplingParams
from tessera.wire.messages import PromptLogprobs, TokenLogprobs


@dataclass
class NewRequestData:
    """Sent when a request is first scheduled, or resumed after preemption (its state was dropped)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens whose KV this step computes
    start_position: int  # how many of the request's tokens were computed before this step
    block_ids: list[int]
    sample: bool  # this chunk reaches the request's last known token: sample the next one
    new: NewRequestData | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    finished_request_ids: list[str] = field(default_factory=list)
    # Those of finished_request_ids that were preempted, not finished: they come back, and their
    # seeded generators must go on from where they were (a seed gives one output, batched or not).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Of those, the ones preempted while a batch that samples them was in flight: that sample is
    # dropped, so the draw it took from a seeded generator is undone.
    discarded_sample_ids: list[str] = field(default_factory=list)
    # The incarnation of each scheduled request (unique per add and per preemption): an output
    # arriving for an older one (pipeline parallelism keeps batches in flight) is dropped.
    incarnations: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    request_ids: list[str]  # the sampled requests, in order
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    # This step's chunk of prompt logprobs, for requests that asked for them (scheduled, sampled or not).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Requests the runner could not serve (request id -> short reason): they fail alone.
    failed: dict[str, str] = field(default_factory=dict)
