"""Turns a SchedulerOutput into one forward pass over a flat batch, and samples.

Per-request state (tokens, blocks, generator) lives here between steps; the
scheduler sends it once (``new``) and then only each step's tokens and blocks.
Decodes are placed first so attention can batch them.

A request that cannot run fails alone, reported in ``ModelRunnerOutput.failed`` while the
batch goes on: one whose inputs are unusable (a token id outside the vocabulary, a seed
torch refuses) is left out of the batch on arrival, alike on every rank; one whose
parameters break sampling is no longer sampled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.config import EngineConfig
from tessera.distributed.intermediate_tensors import IntermediateTensors
from tessera.models.layers.attention import AttentionMetadata
from tessera.models.loader import load_model
from tessera.sampling_params import SamplingParams
from tessera.topology import Topology
from tessera.wire.messages import PromptLogprobs, TokenLogprobs
from tessera.wire.sched_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from tessera.worker.cuda_graphs import DecodeGraphs, capture_sizes, why_eager
from tessera.worker.memory_profile import CudaMemory, DeviceMemory, KVCacheFacts, MemoryProfile
from tessera.worker.sampler import Sampler, SamplerOutput, SamplingMetadata, logprobs_of

logger = logging.getLogger(__name__)

PROMPT_LOGITS_ROWS = 256  # prompt positions scored per LM-head call
CPU = torch.device("cpu")


@dataclass
class CachedRequestState:
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: int | None
    block_ids: list[int]
    generator: torch.Generator | None
    # The generator's state before its latest sample: restored when the scheduler drops that
    # sample (the request was preempted while it was in flight), so a seed gives one output.
    generator_before_sample: torch.Tensor | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


# An odd multiplier (2**32 / the golden ratio): the high half moves the seed far from its neighbours.
_HIGH_HALF_MULTIPLIER = 0x9E37_79B9


def generator_seed(seed: int, device: torch.device) -> int:
    """The seed a request's generator takes. The CPU generator (mt19937) keeps only the low 32
    bits, so seeds that differ above them would draw alike: the high half is folded in, times
    an odd multiplier, so consecutive seeds (the `seed + i` of a request's n choices) stay
    distinct also for negative seeds (an XOR fold maps -1 to 0 and -k to k - 1). Seeds below
    2**32 are unchanged, and CUDA's generator (Philox) keeps all 64 bits."""
    if device.type == "cuda":
        return seed
    unsigned = seed & 0xFFFF_FFFF_FFFF_FFFF  # as torch reads a negative seed
    low, high = unsigned & 0xFFFF_FFFF, unsigned >> 32
    return (low + high * _HIGH_HALF_MULTIPLIER) & 0xFFFF_FFFF


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        topology: Topology | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        topology = topology or Topology(layout=config.parallel)
        self.model = load_model(model_dir, dtype=dtype, device=device, placement=topology.placement)
        context = self.model.max_context
        if config.max_model_len is not None and config.max_model_len > context:
            # Positions past the RoPE table have no meaning the model was trained for (vLLM refuses too).
            raise ValueError(
                f"max_model_len={config.max_model_len} is longer than the model's context of {context} "
                "tokens (max_position_embeddings as its RoPE scaling stretches it, see models/rope_config.py)"
            )
        self.max_model_len = config.max_model_len or context
        self.vocab_size = int(self.model.config.vocab_size)
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # Requests that failed here (id -> reason), reported every step until the scheduler drops them.
        self.failed: dict[str, str] = {}
        # Seeded generators of preempted requests, until they resume (or finish while waiting).
        self.paused_generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []
        # Decode steps replay these once the cache exists (cuda_graphs.py); None: all eager.
        self.decode_graphs: DecodeGraphs | None = None
        self._steps, self._step_seconds = 0, 0.0
        # GPU ranks measure what a profiled step leaves (memory_profile.py) for the sizing.
        self.memory: DeviceMemory | None = CudaMemory(device) if device.type == "cuda" else None
        self.memory_profile: MemoryProfile | None = None
        self._profile_base = 0

    def step_stats(self) -> dict[str, float]:
        return {"steps": self._steps, "step_seconds": self._step_seconds}

    def reset_step_stats(self) -> None:
        self._steps, self._step_seconds = 0, 0.0

    # -- KV cache: measured here, sized by executor/kv_sizing.py ---------------------------------
    def needs_memory_profile(self) -> bool:
        """A GPU rank with no cache size given sizes it by a profiled step."""
        return (
            self.memory is not None
            and self.config.num_kv_blocks is None
            and self.config.kv_cache_memory is None
        )

    def begin_memory_profile(self, num_blocks: int) -> None:
        """A cache for the profile's batch alone; the step that follows is measured."""
        assert self.memory is not None
        self._allocate_kv_cache(num_blocks)
        self._profile_base = self.memory.allocated()
        self.memory.reset_peak()

    def end_memory_profile(self) -> None:
        """Record what the step took, then forget its requests and its cache."""
        assert self.memory is not None
        step_peak = max(0, self.memory.peak() - self._profile_base)
        self.requests.clear()
        self.failed.clear()
        self.paused_generators.clear()
        self.kv_caches = []
        self.memory.release_cached()
        free, total = self.memory.free_and_total()
        outside_torch = max(0, total - free - self.memory.reserved())
        self.memory_profile = MemoryProfile(self.memory.allocated(), step_peak, outside_torch)
        logger.info(
            "memory profile: weights %.2f GiB, a step's peak %.2f GiB, outside torch %.2f GiB",
            *(value / 2**30 for value in (self.memory_profile.weights, step_peak, outside_torch)),
        )

    def kv_cache_facts(self) -> KVCacheFacts:
        """This rank's cache shape and, on a GPU, its profile and the device's memory."""
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec
        element_size = torch.empty((), dtype=self.dtype).element_size()
        if self.memory is None:
            return KVCacheFacts(num_layers, num_kv_heads, head_dim, element_size, on_gpu=False)
        _free, total = self.memory.free_and_total()
        profile = self.memory_profile
        return KVCacheFacts(
            num_layers,
            num_kv_heads,
            head_dim,
            element_size,
            on_gpu=True,
            device_total=total,
            weights=None if profile is None else profile.weights,
            step_peak=None if profile is None else profile.step_peak,
            outside_torch=None if profile is None else profile.outside_torch,
        )

    def init_kv_cache(self, num_blocks: int) -> None:
        """The cache of the size the executor decided (kv_sizing.py); on a CUDA rank the decode
        graphs are captured over it (they record its addresses)."""
        self._allocate_kv_cache(num_blocks)
        self.decode_graphs = None
        reason = why_eager(self.config, self.device)
        if reason is not None:
            if self.device.type == "cuda":
                logger.info("decode steps run eagerly: %s", reason)
            return
        graphs = DecodeGraphs(
            self.model,
            self.kv_caches,
            capture_sizes(self.config),
            self.max_model_len,
            self.block_size,
            self.device,
        )
        graphs.capture()
        self.decode_graphs = graphs

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        num_layers, num_kv_heads, head_dim = self.model.kv_cache_spec
        shape = (2, num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    # -- one step ---------------------------------------------------------------------------------
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        preempted = set(scheduler_output.preempted_request_ids)
        discarded = set(scheduler_output.discarded_sample_ids)
        for request_id in scheduler_output.finished_request_ids:
            state = self.requests.pop(request_id, None)
            self.failed.pop(request_id, None)
            generator = self.paused_generators.pop(request_id, None)
            if request_id in preempted:
                if state is not None:
                    generator = state.generator
                    drew = state.generator_before_sample
                    if request_id in discarded and generator is not None and drew is not None:
                        generator.set_state(drew)
                if generator is not None:
                    self.paused_generators[request_id] = generator
        for scheduled in scheduler_output.scheduled:
            if scheduled.request_id in self.failed and scheduled.request_id not in self.requests:
                continue  # refused on arrival: every rank refuses it alike and leaves it out
            state = self.requests.get(scheduled.request_id)
            if scheduled.new is not None:
                try:
                    state = self._new_state(scheduled)
                except ValueError as error:
                    self.failed[scheduled.request_id] = str(error)
                    continue
                self.requests[scheduled.request_id] = state
            assert state is not None, f"unknown request {scheduled.request_id}"
            state.block_ids = scheduled.block_ids
            known = len(state.token_ids) - scheduled.start_position
            if known < len(scheduled.token_ids):
                state.token_ids.extend(scheduled.token_ids[known:])

    def _new_state(self, scheduled: ScheduledRequest) -> CachedRequestState:
        """The state of a request first scheduled (or resumed); ValueError when it cannot run here."""
        new = scheduled.new
        assert new is not None
        token_ids = new.prompt_token_ids + new.output_token_ids
        if any(not 0 <= token < self.vocab_size for token in token_ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}) for this model")
        generator = self.paused_generators.pop(scheduled.request_id, None)  # resumed: goes on
        if generator is None and new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device)
            try:
                generator.manual_seed(generator_seed(new.sampling_params.seed, self.device))
            except (RuntimeError, OverflowError, ValueError) as error:
                raise ValueError("seed is out of range") from error
        return CachedRequestState(
            token_ids=token_ids,
            num_prompt_tokens=len(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            eos_token_id=new.eos_token_id,
            block_ids=scheduled.block_ids,
            generator=generator,
        )

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        params = [state.sampling_params for state in states]
        generators = {row: s.generator for row, s in enumerate(states) if s.generator is not None}
        blocked: dict[int, list[int]] = {}
        for row, state in enumerate(states):
            if len(state.output_token_ids) < state.sampling_params.min_tokens:
                stops = list(state.sampling_params.stop_token_ids)
                if state.eos_token_id is not None:
                    stops.append(state.eos_token_id)
                # An id the model cannot produce needs no blocking (and would index past the logits).
                blocked[row] = [token for token in stops if 0 <= token < self.vocab_size]
        needs_prompt = any(p.repetition_penalty != 1.0 for p in params)
        return SamplingMetadata.from_params(
            params,
            output_token_ids=[state.output_token_ids for state in states],
            prompt_token_ids=[state.token_ids[: state.num_prompt_tokens] for state in states]
            if needs_prompt
            else None,
            generators=generators,
            blocked_token_ids=blocked,
            device=self.device,
        )

    @torch.inference_mode()
    def execute_model(
        self,
        scheduler_output: SchedulerOutput,
        receive: Callable[[int], IntermediateTensors] | None = None,
        sample: bool = True,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """One forward pass of this rank's layers.

        A pipeline stage after the first gets its input from ``receive(num_tokens)`` (the previous
        stage's output for this batch); a stage before the last returns the activations for the
        next stage; the last stage computes logits (a collective over its TP group) and, where
        ``sample``, samples.
        """
        started = time.perf_counter()
        try:
            return self._execute(scheduler_output, receive, sample)
        finally:
            self._steps += 1
            self._step_seconds += time.perf_counter() - started

    def _execute(
        self,
        scheduler_output: SchedulerOutput,
        receive: Callable[[int], IntermediateTensors] | None,
        sample: bool,
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        self._update_states(scheduler_output)
        # Decodes first (stable sort keeps the scheduler's order within each kind).
        batch = sorted(
            (s for s in scheduler_output.scheduled if s.request_id in self.requests),
            key=lambda s: len(s.token_ids) != 1,
        )
        if not batch:
            return ModelRunnerOutput(request_ids=[], sampled_token_ids=[], failed=dict(self.failed))
        graphs = self.decode_graphs
        if graphs is not None and receive is None and graphs.fits(batch):
            # The inputs stay on the host: the graph's static buffers take them in one copy.
            input_ids, positions, metadata = step_inputs(batch, self.block_size, CPU)
            hidden_states = graphs.run(input_ids, positions, metadata)
        else:
            input_ids, positions, metadata = step_inputs(batch, self.block_size, self.device)
            intermediate_tensors = None if receive is None else receive(int(positions.shape[0]))
            hidden_states = self.model(input_ids, positions, self.kv_caches, metadata, intermediate_tensors)
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states

        prompt_logprobs = self._prompt_logprobs(batch, metadata, hidden_states, sample)
        # A request that failed in sampling stays in the forward pass until the scheduler drops it
        # (only the sampling rank knows, and every stage must run the same batch) but is not sampled.
        sampled = [row for row, s in enumerate(batch) if s.sample and s.request_id not in self.failed]
        if not sampled:
            return ModelRunnerOutput(
                request_ids=[],
                sampled_token_ids=[],
                prompt_logprobs=prompt_logprobs,
                failed=dict(self.failed),
            )
        last_token_rows = torch.tensor([metadata.query_start_loc_list[row + 1] - 1 for row in sampled])
        # The sampler stays outside the graphs: its parameters, generators and penalties vary per
        # step and branch on the host, and a row that breaks sampling fails alone (_sample).
        logits = self.model.compute_logits(hidden_states[last_token_rows.to(self.device)])
        if not sample:
            return None
        request_ids = [batch[row].request_id for row in sampled]
        output, kept = self._sample(logits, request_ids)
        return ModelRunnerOutput(
            request_ids=[request_ids[row] for row in kept],
            sampled_token_ids=output.sampled_token_ids.tolist() if output is not None else [],
            logprobs=_token_logprobs(output),
            prompt_logprobs=prompt_logprobs,
            failed=dict(self.failed),
        )

    def _prompt_logprobs(
        self,
        batch: list[ScheduledRequest],
        metadata: AttentionMetadata,
        hidden_states: torch.Tensor,
        sample: bool,
    ) -> dict[str, PromptLogprobs]:
        """Scores this step's prompt positions, for requests that asked: the logprob of each next
        prompt token. Every rank of the last stage computes the logits (a TP collective, decided from
        what all ranks know); only the sampling rank reduces them."""
        spans = []  # (request id, first scored position, its hidden row, positions, top-k)
        for row, scheduled in enumerate(batch):
            state = self.requests[scheduled.request_id]
            num_top = state.sampling_params.prompt_logprobs
            # A request with outputs has sent its prompt's logprobs (with its first token): one
            # resumed after preemption recomputes its prompt, and it is not scored again.
            if num_top is None or len(state.token_ids) > state.num_prompt_tokens:
                continue
            start = scheduled.start_position
            count = min(start + len(scheduled.token_ids), state.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append(
                    (scheduled.request_id, start + 1, metadata.query_start_loc_list[row], count, num_top)
                )
        if not spans:
            return {}
        rows = torch.tensor([first_row + i for _, _, first_row, count, _ in spans for i in range(count)])
        targets = torch.tensor(
            [
                self.requests[rid].token_ids[first + i]
                for rid, first, _, count, _ in spans
                for i in range(count)
            ]
        )
        num_top = max(span[4] for span in spans)
        scored: list[tuple[float, list[int], list[float], int]] = []
        for begin in range(0, len(rows), PROMPT_LOGITS_ROWS):  # bounds the [rows, vocab] logits
            logits = self.model.compute_logits(
                hidden_states[rows[begin : begin + PROMPT_LOGITS_ROWS].to(self.device)]
            )
            if sample:
                raw = logits.float().log_softmax(dim=-1)
                part = logprobs_of(raw, targets[begin : begin + PROMPT_LOGITS_ROWS].to(self.device), num_top)
                scored += zip(*(t.tolist() for t in part), strict=True)
        if not sample:
            return {}
        result, taken = {}, 0
        for request_id, first, _, count, top in spans:
            entries = [
                TokenLogprobs(logprob=lp, top_token_ids=ids[:top], top_logprobs=lps[:top], rank=rank)
                for lp, ids, lps, rank in scored[taken : taken + count]
            ]
            taken += count
            if request_id not in self.failed:
                result[request_id] = PromptLogprobs(first_position=first, entries=entries)
        return result

    def _sample(self, logits: torch.Tensor, request_ids: list[str]) -> tuple[SamplerOutput | None, list[int]]:
        """Sample every row; rows whose parameters break sampling fail alone (kept: the other rows).

        Only when the batch fails are rows tried one by one, generators rewound before each try, so
        seeded rows draw the same noise as without the failure. A batch of several rows in which
        every row fails alone is a fault of the engine, not of a request: it is raised.
        """
        states = [self.requests[request_id] for request_id in request_ids]
        rewind = _GeneratorRewind(states)
        try:
            return self.sampler(logits, self._sampling_metadata(states)), list(range(len(states)))
        except Exception as failure:
            batch_failure = failure
        failures: dict[int, Exception] = {}
        for row, state in enumerate(states):
            rewind()
            try:
                self.sampler(logits[row : row + 1], self._sampling_metadata([state]))
            except Exception as failure:
                failures[row] = failure
        if len(states) > 1 and len(failures) == len(states):
            raise batch_failure
        for row, row_failure in failures.items():
            logger.error("request %s failed in sampling", request_ids[row], exc_info=row_failure)
            self.failed[request_ids[row]] = f"sampling failed ({type(row_failure).__name__})"
        kept = [row for row in range(len(states)) if row not in failures]
        rewind()
        if not kept:
            return None, []
        kept_states = [states[row] for row in kept]
        return self.sampler(logits[kept], self._sampling_metadata(kept_states)), kept


def step_inputs(
    batch: list[ScheduledRequest], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step's token ids, positions and attention metadata (decodes first in ``batch``)."""
    # Plain lists first, one tensor each after: per-request tensors and indexing ops cost
    # more than the arithmetic at decode's one token per request.
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    max_blocks = max(len(scheduled.block_ids) for scheduled in batch)
    padded_block_ids: list[list[int]] = []
    for scheduled in batch:
        start, count, block_ids = scheduled.start_position, len(scheduled.token_ids), scheduled.block_ids
        input_ids.extend(scheduled.token_ids)
        positions.extend(range(start, start + count))
        for block in range(start // block_size, (start + count - 1) // block_size + 1):
            first, end = max(start, block * block_size), min(start + count, (block + 1) * block_size)
            offset = (block_ids[block] - block) * block_size  # position -> slot within this block
            slots.extend(range(first + offset, end + offset))
        query_start_loc.append(query_start_loc[-1] + count)
        seq_lens.append(start + count)
        padded_block_ids.append(block_ids + [0] * (max_blocks - len(block_ids)))
    block_tables = torch.tensor(padded_block_ids, dtype=torch.int64)
    positions_cpu = torch.tensor(positions, dtype=torch.int64)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    num_decodes = 0
    while num_decodes < len(batch) and len(batch[num_decodes].token_ids) == 1:
        num_decodes += 1
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_tables=block_tables.to(device),
        num_decodes=num_decodes,
        max_seq_len=max(seq_lens),
        query_start_loc_list=query_start_loc,
        seq_lens_list=seq_lens,
    )
    return torch.tensor(input_ids, dtype=torch.int64, device=device), positions_cpu.to(device), metadata


class _GeneratorRewind:
    """Restores the seeded generators of some requests to their state at construction."""

    def __init__(self, states: list[CachedRequestState]) -> None:
        self._saved = []
        for state in states:
            if state.generator is not None:
                state.generator_before_sample = state.generator.get_state()
                self._saved.append((state.generator, state.generator_before_sample))

    def __call__(self) -> None:
        for generator, state in self._saved:
            generator.set_state(state)


def _token_logprobs(output: SamplerOutput | None) -> list[TokenLogprobs] | None:
    if (
        output is None
        or output.logprobs is None
        or output.top_token_ids is None
        or output.top_logprobs is None
        or output.ranks is None
    ):
        return None
    return [
        TokenLogprobs(logprob=lp, top_token_ids=ids, top_logprobs=lps, rank=rank)
        for lp, ids, lps, rank in zip(
            output.logprobs.tolist(),
            output.top_token_ids.tolist(),
            output.top_logprobs.tolist(),
            output.ranks.tolist(),
            strict=True,
        )
    ]
