"""Activations across a pipeline-stage boundary: point-to-point, shapes before tensors.

Each TP rank of stage s sends to the same TP rank of stage s+1 (with sequence parallelism
that is only its shard of the tokens: the residual differs per rank, so it must never be
gathered for transport). Every tensor is preceded by a small header (step id, rows, columns,
dtype) that the receiver checks before it posts a buffer: a gloo receive into a buffer of
the wrong size aborts the process, a checked header raises a clear error instead.

Sends are asynchronous (a gloo send waits for the receiver to post its buffer), so a stage
goes on with the next batch in flight while the next stage is still busy.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tessera.distributed.communication import COMM_STATS
from tessera.distributed.intermediate_tensors import IntermediateTensors
from tessera.distributed.parallel_state import get_pipeline_peers

TENSOR_NAMES = ("hidden_states", "residual")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HEADER_LEN = 4


class PipelineProtocolError(RuntimeError):
    """The previous stage sent something other than what this step expects."""


class PipelineSender:
    """Sends a stage's output onwards; keeps each send alive until it completes."""

    def __init__(self) -> None:
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def send(self, tensors: IntermediateTensors, step_id: int) -> None:
        dst = get_pipeline_peers().next_rank
        if dst is None:
            raise RuntimeError("the last pipeline stage has no next stage to send to")
        self._reap()
        started = time.perf_counter()
        for name in TENSOR_NAMES:
            tensor = tensors[name].contiguous()
            header = torch.tensor(
                [step_id, tensor.shape[0], tensor.shape[1], _DTYPE_CODES[tensor.dtype]],
                dtype=torch.int64,
                device=tensor.device,
            )
            for item in (header, tensor):
                self._pending.append((dist.isend(item, dst), item))
            COMM_STATS.p2p_bytes_sent += tensor.numel() * tensor.element_size()
        COMM_STATS.p2p_seconds += time.perf_counter() - started

    def _reap(self) -> None:
        """Forget sends that completed (older ones complete first: the peer receives in order)."""
        while self._pending and self._pending[0][0].is_completed():
            self._pending.pop(0)

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


def receive(
    step_id: int,
    rows: int,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    upstream_timeout_s: float,
) -> IntermediateTensors:
    """The previous stage's output for ``step_id``: ``rows`` x ``hidden_size`` per tensor, checked.

    Each header may take ``upstream_timeout_s``: it comes when the previous stage has computed its
    share of the step, which may take longer than a collective may (gloo honours the longer wait;
    NCCL's watchdog keeps the process group's limit)."""
    src = get_pipeline_peers().prev_rank
    if src is None:
        raise RuntimeError("the first pipeline stage has no previous stage to receive from")
    started = time.perf_counter()
    tensors: dict[str, torch.Tensor] = {}
    expected = [step_id, rows, hidden_size, _DTYPE_CODES[dtype]]
    for name in TENSOR_NAMES:
        header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
        arriving = dist.irecv(header, src)
        assert arriving is not None  # None only for a rank outside the group
        arriving.wait(timedelta(seconds=upstream_timeout_s))
        got = header.tolist()
        if got != expected:
            raise PipelineProtocolError(
                f"{name} from rank {src}: got (step, rows, cols, dtype) {got}, expected {expected}"
            )
        tensor = torch.empty((rows, hidden_size), dtype=dtype, device=device)
        dist.recv(tensor, src)
        COMM_STATS.p2p_bytes_received += tensor.numel() * tensor.element_size()
        tensors[name] = tensor
    COMM_STATS.p2p_seconds += time.perf_counter() - started
    return IntermediateTensors(tensors)
