"""Native CPU kernels (``csrc/``): compiled on first use and cached (``build.py``).

``native_ops(device)`` is what a model asks for: the compiled kernels for CPU tensors, or None,
and the model then runs its ATen formulation, same results, slower. That is so with
``TESSERA_CPU_KERNELS=0`` (``ENABLED``), and where no C++ compiler can build them.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

from tessera.kernels.build import artifact_state, build_key, cpu_kernels

__all__ = ["ENABLED", "build_key", "build_state", "cpu_kernels", "native_ops"]

# Off with TESSERA_CPU_KERNELS=0; tests comparing the two paths flip this flag.
ENABLED = os.environ.get("TESSERA_CPU_KERNELS", "1") != "0"


def native_ops(device: torch.device) -> ModuleType | None:
    """The kernels to use for tensors on ``device``, or None for the ATen formulation."""
    if not ENABLED or device.type != "cpu":
        return None
    return cpu_kernels()


def build_state() -> tuple[str, Path]:
    """This build's state without building it (``disabled``, ``prebuilt``, ``built`` or ``not
    built``) and where its extension module is, or will be once a model loads."""
    state, extension = artifact_state()
    return ("disabled" if not ENABLED else state), extension
