"""What one pipeline stage hands to the next: named tensors (``hidden_states``, ``residual``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch


class IntermediateTensors(Mapping[str, torch.Tensor]):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def rows(self, start: int, end: int) -> IntermediateTensors:
        """The same tensors restricted to token rows [start, end) (e.g. a sequence-parallel shard)."""
        return IntermediateTensors({name: t[start:end] for name, t in self.tensors.items()})

    def __repr__(self) -> str:
        shapes = {name: tuple(t.shape) for name, t in self.tensors.items()}
        return f"IntermediateTensors({shapes})"
