"""The memory profile's batch (executor/kv_sizing.py) is built from the wire types, below the
scheduler: it must be exactly the batch the scheduler makes of the same fresh prompts."""

from __future__ import annotations

import time

import pytest

from tessera.config import EngineConfig
from tessera.core.request import Request
from tessera.core.scheduler import Scheduler
from tessera.executor.kv_sizing import PROFILE_REQUEST_PREFIX, profile_batch
from tessera.wire.messages import EngineCoreRequest


def scheduled_by_the_scheduler(config: EngineConfig, max_model_len: int, num_blocks: int):  # type: ignore[no-untyped-def]
    settings = {"enable_prefix_caching": False, "long_prefill_token_threshold": 0}
    scheduler = Scheduler(config.model_copy(update=settings), num_blocks, max_model_len)
    batch, _ = profile_batch(config, max_model_len)
    for scheduled in batch.scheduled:
        assert scheduled.new is not None and scheduled.request_id.startswith(PROFILE_REQUEST_PREFIX)
        request = EngineCoreRequest(
            scheduled.request_id, list(scheduled.token_ids), scheduled.new.sampling_params, None, time.time()
        )
        scheduler.add_request(Request.from_engine_core_request(request))
    return scheduler.schedule()


@pytest.mark.parametrize(
    ("settings", "max_model_len"),
    [
        ({"max_num_batched_tokens": 64, "max_num_seqs": 8, "block_size": 4}, 128),
        ({"max_num_batched_tokens": 64, "max_num_seqs": 1, "block_size": 4}, 32),
        ({"max_num_batched_tokens": 96, "max_num_seqs": 4, "block_size": 8}, 128),
        ({"max_num_batched_tokens": 8192, "max_num_seqs": 256, "block_size": 16}, 4096),
        ({"max_num_batched_tokens": 100, "max_num_seqs": 7, "block_size": 16}, 20),
        (
            {
                "max_num_batched_tokens": 5,
                "max_num_seqs": 16,
                "block_size": 16,
                "enable_chunked_prefill": False,
            },
            64,
        ),
    ],
)
def test_the_profile_batch_is_the_one_the_scheduler_makes(
    settings: dict[str, object], max_model_len: int
) -> None:
    config = EngineConfig(model="m", **settings)  # type: ignore[arg-type]
    batch, num_blocks = profile_batch(config, max_model_len)
    assert batch == scheduled_by_the_scheduler(config, max_model_len, num_blocks)
