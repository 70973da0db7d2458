"""The Triton kernels on CPU, run by Triton's interpreter (tests/conftest.py switches it on for
the whole session, before anything imports Triton)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def interpreted_kernels() -> ModuleType:
    module = importlib.import_module("tessera.kernels.triton")
    if not module.INTERPRETED:
        raise RuntimeError("tessera.kernels.triton was imported before TRITON_INTERPRET=1 was set")
    return module
