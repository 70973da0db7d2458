"""A small deterministic stand-in for EngineCore, for unit tests of the process and client plumbing.

Each request generates tokens prompt[-1]+1, +2, ... one per step until max_tokens; a prompt
token 666 makes step() raise (to test the death path).
"""

from __future__ import annotations

import os

from tessera.config import EngineConfig
from tessera.wire.messages import (
    FINISH_LENGTH,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)

CRASH_TOKEN = 666


class FakeEngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.max_model_len = 64
        self.requests: dict[str, tuple[EngineCoreRequest, int]] = {}

    def add_request(self, req: EngineCoreRequest) -> None:
        self.requests[req.request_id] = (req, 0)

    def abort_requests(self, ids: list[str]) -> None:
        for request_id in ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.requests), kv_cache_usage=0.1 * len(self.requests))

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for request_id, (req, produced) in list(self.requests.items()):
            if CRASH_TOKEN in req.prompt_token_ids:
                os._exit(3)
            produced += 1
            done = produced >= (req.sampling_params.max_tokens or 1)
            outputs.append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[req.prompt_token_ids[-1] + produced],
                    finish_reason=FINISH_LENGTH if done else None,
                )
            )
            if done:
                del self.requests[request_id]
            else:
                self.requests[request_id] = (req, produced)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.make_stats())

    def shutdown(self) -> None:
        pass
