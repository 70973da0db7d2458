"""The engine core: scheduler + executor, one step at a time.

In-process for the offline ``LLM``; wrapped in its own busy-loop process for serving.

With pipeline parallelism up to ``pp_size`` batches are in flight (vLLM's batch queue): a
step submits a new batch while there is room and work, and otherwise finishes the oldest
batch in flight. A request in flight is not scheduled again until its token returns (the
scheduler advanced its computed tokens when it scheduled it). With one stage this is the
plain loop: schedule, execute, update.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future

from tessera.config import EngineConfig
from tessera.core.request import Request, RequestRejected
from tessera.core.scheduler import Scheduler
from tessera.engine.processor import model_vocab_size
from tessera.executor import make_executor
from tessera.models.registry import resolve_model
from tessera.sampling_params import SamplingParams
from tessera.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from tessera.wire.sched_output import ModelRunnerOutput, SchedulerOutput

WARM_UP_REQUEST_ID = "tessera-warm-up"


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.vocab_size = model_vocab_size(self.model_dir)
        self.executor = make_executor(config, self.model_dir)
        try:
            self.max_model_len = self.executor.max_model_len
            self.num_kv_blocks = self.executor.num_kv_blocks
            self.block_size = config.block_size
            self.max_concurrent_batches = config.max_batches_in_flight or self.executor.max_concurrent_batches
            self.scheduler = Scheduler(
                config, self.num_kv_blocks, self.max_model_len, pipeline_depth=self.max_concurrent_batches
            )
            self.batch_queue: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
            if config.world_size > 1:
                self._warm_up()
        except BaseException:
            self.executor.shutdown()  # the rank processes must not outlive an engine never made
            raise

    def _warm_up(self) -> None:
        """A few tokens through every rank before anyone calls the engine ready: rendezvous, every
        stage-to-stage transfer and every collective have then worked once."""
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len={self.max_model_len} leaves no room for a prompt and a token")
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        prompt = [0] * min(4, self.max_model_len - 1)
        self.add_request(EngineCoreRequest(WARM_UP_REQUEST_ID, prompt, params, None, time.time()))
        while self.has_unfinished_requests():
            self.step()
        self.reset_prefix_cache()

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; RequestRejected (nothing changed) if it can never run here."""
        checked = Request.from_engine_core_request(request)  # the fields' types first: a wire message
        # Checked before any block is allocated: a prompt the runner refuses would leave blocks
        # registered in the prefix cache that nobody writes.
        params = checked.sampling_params
        # The ids the sampler indexes the logits with (a stop id beyond the vocabulary just never
        # matches): the frontend's admission checked them, a caller of AsyncLLM that skips it is
        # refused here with the same clarity.
        for what, ids in (
            ("prompt token ids", checked.prompt_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
        ):
            outside = [t for t in ids if not 0 <= t < self.vocab_size]
            if outside:
                raise RequestRejected(
                    f"{what} must be in [0, {self.vocab_size}) for this model, got {outside[:5]}"
                )
        self.scheduler.add_request(checked)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        outputs: list[EngineCoreOutput] = []
        submitted = self._submit()
        # Room for another batch in flight: fill the pipeline before waiting on the oldest.
        if self.batch_queue and not (submitted and len(self.batch_queue) < self.max_concurrent_batches):
            scheduler_output, future = self.batch_queue.popleft()
            outputs = self.scheduler.update_from_output(scheduler_output, self.executor.wait(future))
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()
        )

    def _submit(self) -> bool:
        """Schedule a batch and hand it to the executor, if there is room and work; True if it did."""
        if (
            len(self.batch_queue) >= self.max_concurrent_batches
            or not self.scheduler.has_unfinished_requests()
        ):
            return False
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return False
        future = self.executor.execute_model(scheduler_output, non_block=True)
        assert isinstance(future, Future)
        self.batch_queue.append((scheduler_output, future))
        return True

    def check_health(self) -> None:
        """Raise when the ranks are gone, so an idle engine fails as promptly as a busy one."""
        self.executor.check_health()

    def make_stats(self):  # -> SchedulerStats
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
