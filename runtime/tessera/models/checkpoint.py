"""Checkpoint tensors read lazily: a rank materializes only the slices its parameters hold.

``CheckpointTensor`` wraps one safetensors entry; the layers' weight loaders call ``narrow``
or slice it exactly as they would a tensor, and only those bytes are read from the
(memory-mapped) file. ``BYTES_READ`` counts them, so tests can show that a TP rank reads its
share of the model and a pipeline stage never touches other stages' layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


class ReadCounter:
    def __init__(self) -> None:
        self.bytes = 0

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor


BYTES_READ = ReadCounter()


class CheckpointTensor:
    """One tensor of a safetensors file, not yet read."""

    def __init__(self, lazy_slice: Any, name: str) -> None:
        self._slice = lazy_slice
        self.name = name
        self.shape = torch.Size(lazy_slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim < 0:
            dim += len(self.shape)
        index = tuple([slice(None)] * dim + [slice(start, start + length)])
        return BYTES_READ.add(self._slice[index])

    def __getitem__(self, index: slice) -> torch.Tensor:
        return BYTES_READ.add(self._slice[index])

    def materialize(self) -> torch.Tensor:
        return BYTES_READ.add(self._slice[:])


def materialize(tensor: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return tensor.materialize() if isinstance(tensor, CheckpointTensor) else tensor


def iterate_lazily(files: list[Path]) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, unread tensor) for every tensor of the files, each file open while it is iterated."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointTensor(handle.get_slice(name), name)
