"""Kernel tests never record GEMM verdicts into the machine's real selection file."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tessera.kernels import gemm_selection


@pytest.fixture(autouse=True)
def selection_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test starts with no recorded verdicts (in the file or kept unrecorded by this process)
    and no forced backend, and records its verdicts whatever else the machine runs meanwhile (the
    contention test runs its own process)."""
    path = tmp_path / gemm_selection.SELECTION_FILE
    monkeypatch.setattr(gemm_selection, "selection_path", lambda: path)
    prebuilt = tmp_path / "prebuilt" / gemm_selection.SELECTION_FILE
    monkeypatch.setattr(gemm_selection, "prebuilt_selection_path", lambda: prebuilt)
    monkeypatch.setattr(gemm_selection, "_unrecorded_verdicts", {})
    monkeypatch.setattr(gemm_selection, "CONTENTION_LIMIT_CPUS", math.inf)
    monkeypatch.delenv(gemm_selection.FORCE_VARIABLE, raising=False)
    return path
