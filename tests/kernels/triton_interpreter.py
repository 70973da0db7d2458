"""The Triton kernels on CPU, run by Triton's interpreter, without leaking its switch.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when ``tessera.kernels.triton``
is first imported; nothing else in the runtime imports it off a GPU path. The fixture sets
the variable, imports the package and restores the variable after its module's tests.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def interpreted_kernels() -> Iterator[ModuleType]:
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("tessera.kernels.triton")
        if not module.INTERPRETED:
            raise RuntimeError("tessera.kernels.triton was imported before TRITON_INTERPRET=1 was set")
        yield module
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
