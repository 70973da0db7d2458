"""Tessera: a vLLM-V1-style engine runtime.

``from tessera import LLM, SamplingParams``. Heavy imports (torch, transformers) are
lazy, so torch-free parts such as ``tessera.topology`` stay light for the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.version import __version__ as __version__  # re-exported

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from tessera.entrypoints.llm import LLM
    from tessera.outputs import CompletionOutput, RequestOutput
    from tessera.sampling_params import SamplingParams

_LAZY = {
    "LLM": "tessera.entrypoints.llm",
    "SamplingParams": "tessera.sampling_params",
    "RequestOutput": "tessera.outputs",
    "CompletionOutput": "tessera.outputs",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
