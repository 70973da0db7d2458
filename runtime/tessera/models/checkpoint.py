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
    """One tensor of a safetensors file (or a block of it along dim 0), not yet read."""

    def __init__(self, lazy_slice: Any, name: str, rows: tuple[int, int] | None = None) -> None:
        self._slice = lazy_slice
        self.name = name
        shape = list(lazy_slice.get_shape())
        # [start, start + length) of the file's dim 0 this tensor stands for: a fused tensor's part.
        self._rows = rows or (0, shape[0] if shape else 0)
        if shape:
            shape[0] = self._rows[1]
        self.shape = torch.Size(shape)

    def rows(self, start: int, length: int) -> CheckpointTensor:
        """Rows [start, start + length), still unread (a part of a fused checkpoint tensor)."""
        if start < 0 or length < 0 or start + length > self.shape[0]:
            raise ValueError(
                f"rows [{start}, {start + length}) lie outside {self.name} of shape {tuple(self.shape)}"
            )
        return CheckpointTensor(self._slice, self.name, (self._rows[0] + start, length))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim < 0:
            dim += len(self.shape)
        bounds = [slice(0, size) for size in self.shape]
        bounds[dim] = slice(start, start + length)
        return self._read(bounds)

    def __getitem__(self, index: slice) -> torch.Tensor:
        start, stop, step = index.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"{self.name}: only contiguous rows are read")
        return self.narrow(0, start, max(stop - start, 0))

    def materialize(self) -> torch.Tensor:
        return self._read([slice(0, size) for size in self.shape])

    def _read(self, bounds: list[slice]) -> torch.Tensor:
        if bounds:  # in the file's coordinates: shifted by this tensor's first row
            offset = self._rows[0]
            bounds[0] = slice(bounds[0].start + offset, bounds[0].stop + offset)
        return BYTES_READ.add(self._slice[tuple(bounds)])


def take_rows(
    tensor: torch.Tensor | CheckpointTensor, start: int, length: int
) -> torch.Tensor | CheckpointTensor:
    """Rows [start, start + length) of a checkpoint tensor, read no sooner than the whole would be."""
    if isinstance(tensor, CheckpointTensor):
        return tensor.rows(start, length)
    return tensor.narrow(0, start, length)


def materialize(tensor: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return tensor.materialize() if isinstance(tensor, CheckpointTensor) else tensor


def iterate_lazily(files: list[Path]) -> Iterator[tuple[str, CheckpointTensor]]:
    """(name, unread tensor) for every tensor of the files, each file open while it is iterated."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, CheckpointTensor(handle.get_slice(name), name)
