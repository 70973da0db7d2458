"""CUDA graphs for decode-only batches, as vLLM captures them: one graph per padded batch size.

At decode a step's work is a few hundred small kernel launches (every layer's GEMMs, norms,
rotary, the KV write, the attention), so the host's launch overhead bounds a small batch's
speed. After the KV cache exists, ``DecodeGraphs.capture`` records the model's forward once
per batch size of ``capture_sizes`` over static input buffers; a step whose batch is all
decodes and fits a captured size then copies its inputs into those buffers (``load``),
replays the graph and takes the real rows of its output. Anything else (a prefill in the
batch, more decodes than the largest size) runs eagerly.

What makes the forward capturable (fixed per graph, no host sync inside it):
- Padding rows of a size read token 0 at position 0, write no KV (slot -1: the cache-write
  kernel skips negative slots) and attend one key of block 0 (seq_len 1), which keeps them
  finite; their outputs are dropped.
- Block tables are as wide as max_model_len needs, and the decode kernel's context split is
  planned for max_model_len (``metadata``): the grid and the partials' workspace are the same
  on every replay, whatever the contexts are.
- The Triton plan launches no prefill when the batch is all decodes (no tile list is built).

The sampler is not in the graph: sampling parameters, seeded per-request generators, penalties
and min-token blocking vary per step and branch on the host, and a row whose parameters break
sampling must fail alone (``ModelRunner._sample``); the logits of the real rows are computed
eagerly after the replay (one GEMM).

The graphs' memory (one pool shared by every size, the largest captured first) is taken after
the KV cache was sized, from what ``gpu_memory_utilization`` left: it holds one decode step's
activations at the largest size, far below the profiled step of ``max_num_batched_tokens``
tokens, and its size is logged.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from tessera.config import EngineConfig
from tessera.models.layers.attention import AttentionMetadata
from tessera.models.layers.triton_attention import uses_triton
from tessera.wire.sched_output import ScheduledRequest

logger = logging.getLogger(__name__)

# vLLM's default largest capture size: beyond it a decode batch is compute-bound, launches are cheap.
MAX_CAPTURE_SIZE = 512
# Rows of the staged step inputs: token ids, positions, KV slots, context lengths.
_INPUT_ROWS = 4


def capture_sizes(config: EngineConfig) -> list[int]:
    """The padded batch sizes to capture, ascending: ``config.cuda_graph_sizes`` if given, else
    vLLM's 1, 2, 4, then multiples of 8, up to the first that holds max_num_seqs decodes (capped
    at MAX_CAPTURE_SIZE)."""
    most = min(config.max_num_seqs, config.max_num_batched_tokens)
    if config.cuda_graph_sizes is not None:
        return sorted(set(config.cuda_graph_sizes))  # validated by EngineConfig
    sizes = []
    for size in [1, 2, 4, *range(8, MAX_CAPTURE_SIZE + 1, 8)]:
        sizes.append(size)
        if size >= most:
            break
    return sizes


def padded_size(sizes: list[int], num_decodes: int) -> int | None:
    """The smallest captured size that holds ``num_decodes`` rows; None when none does."""
    index = bisect.bisect_left(sizes, num_decodes)
    return sizes[index] if index < len(sizes) else None


def why_eager(config: EngineConfig, device: torch.device) -> str | None:
    """Why this rank runs every step eagerly, or None when it captures decode graphs."""
    if config.enforce_eager:
        return "enforce_eager is set"
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if not uses_triton(device):
        return "the attention backend is not Triton (only its kernels are planned for capture)"
    if config.parallel.world_size > 1:
        # TP all-reduces under NCCL are capturable, but neither they nor pipeline stages (whose
        # receive blocks on the host) have been run in a graph here: kept eager until they are.
        return f"world size {config.parallel.world_size}: graphs are captured on a single rank only"
    return None


class StaticDecodeInputs:
    """The input buffers every graph reads (a size's graph reads their first ``size`` rows)."""

    def __init__(self, max_size: int, max_blocks: int, device: torch.device) -> None:
        self.max_size, self.device = max_size, device
        self.rows = torch.zeros(_INPUT_ROWS, max_size, dtype=torch.int64, device=device)
        # Stale block ids left by earlier steps stay valid ids: only keys < seq_len are read.
        self.block_tables = torch.zeros(max_size, max_blocks, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int64, device=device)
        # The host side of one step's rows, pinned on a GPU so its copy is one DMA; the event
        # says when that copy is done, so the next step does not overwrite what is still read.
        on_gpu = device.type == "cuda"
        self._staged = torch.empty(_INPUT_ROWS, max_size, dtype=torch.int64, pin_memory=on_gpu)
        self._copied = torch.cuda.Event() if on_gpu else None
        self.pad(max_size)

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def pad(self, size: int, first: int = 0) -> None:
        """Rows [first, size) become padding: token 0 at position 0, no KV slot, one key."""
        self.rows[:, first:size] = torch.tensor([0, 0, -1, 1], device=self.device)[:, None]

    def load(
        self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> None:
        """A decode batch's step inputs (CPU tensors from ``step_inputs``) into the first rows, the
        rest of ``size`` padding."""
        count = input_ids.shape[0]
        if self._copied is not None:
            self._copied.synchronize()
        staged = self._staged[:, :size]
        staged[:, count:] = torch.tensor([0, 0, -1, 1])[:, None]
        for row, values in enumerate((input_ids, positions, md.slot_mapping, md.seq_lens)):
            staged[row, :count] = values
        self.rows[:, :size].copy_(staged, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        width = md.block_tables.shape[1]
        self.block_tables[:count, :width].copy_(md.block_tables)

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        """The attention metadata of a size's graph: every row a decode, the context split planned
        for max_model_len (the host lists say so; the kernels read the device tensors)."""
        return AttentionMetadata(
            slot_mapping=self.rows[2, :size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.rows[3, :size],
            block_tables=self.block_tables[:size],
            num_decodes=size,
            max_seq_len=max_model_len,
            query_start_loc_list=list(range(size + 1)),
            seq_lens_list=[max_model_len] * size,
        )


class DecodeGraphs:
    """The decode graphs of one rank: captured once, replayed for every decode-only step they fit."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches, self.sizes = model, kv_caches, sizes
        self.max_model_len = max_model_len
        self.inputs = StaticDecodeInputs(sizes[-1], -(-max_model_len // block_size), device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps a graph ran (benchmarks/gpu_check.py reports it)

    def forward_on_inputs(self, size: int) -> torch.Tensor:
        """The model's forward over the static inputs' first ``size`` rows (what a graph records)."""
        inputs = self.inputs
        hidden_states = self.model(
            inputs.rows[0, :size],
            inputs.rows[1, :size],
            self.kv_caches,
            inputs.metadata(size, self.max_model_len),
        )
        assert isinstance(hidden_states, torch.Tensor)
        return hidden_states

    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first (the smaller ones reuse its pool's memory)."""
        started = time.perf_counter()
        before = torch.cuda.memory_reserved(self.inputs.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.inputs.pad(size)
            # Outside the graph first: Triton compiles its kernels and cuBLAS picks its algorithms.
            self.forward_on_inputs(size)
            torch.cuda.synchronize(self.inputs.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.forward_on_inputs(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.inputs.device)
        logger.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s (%.0f MiB of graph memory)",
            self.sizes,
            time.perf_counter() - started,
            (torch.cuda.memory_reserved(self.inputs.device) - before) / 2**20,
        )

    def fits(self, batch: list[ScheduledRequest]) -> bool:
        """Whether a graph runs this batch: every request decodes one token, a size holds them all."""
        return (
            padded_size(self.sizes, len(batch)) is not None
            and all(len(scheduled.token_ids) == 1 for scheduled in batch)
            and max(len(scheduled.block_ids) for scheduled in batch) <= self.inputs.max_blocks
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the smallest size that holds this decode batch; its real rows' hidden
        states (a view of the graph's output, valid until the next replay)."""
        count = input_ids.shape[0]
        size = padded_size(self.sizes, count)
        assert size is not None and md.num_decodes == count, "run() takes decode batches that fit()"
        self.inputs.load(size, input_ids, positions, md)
        self._graphs[size].replay()
        self.replays += 1
        return self._outputs[size][:count]
