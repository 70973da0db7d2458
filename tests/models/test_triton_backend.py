"""The Triton attention backend (Triton's interpreter on CPU) inside a model: every phase of the
paged-cache scenario gives the ATen formulation's logits."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tessera import kernels
from tessera.models.layers import triton_attention
from tessera.models.layers.attention import AttentionPlan, GatherWorkspace
from tessera.models.loader import load_model
from tests.fixtures.models import make_tiny_model_dir
from tests.kernels.triton_interpreter import interpreted_kernels
from tests.models.scenario import run_scenario

__all__ = ["interpreted_kernels"]

torch.set_num_threads(2)
CPU = torch.device("cpu")


def scenario_logits(folder: Path, backend: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    monkeypatch.setattr(triton_attention, "SELECTED", backend)
    monkeypatch.setattr(kernels, "ENABLED", False)  # "auto" on CPU: the ATen formulation
    model = load_model(folder, dtype=torch.float32, device=CPU)
    driver, records = run_scenario(model, vocab=512)
    plan = AttentionPlan.build(driver.last_metadata, driver.block_size, CPU, GatherWorkspace())
    assert (plan.triton is not None) == (backend == "triton")
    return records


@pytest.mark.parametrize(
    "arch, options",
    [("llama", {}), ("mistral", {"sliding_window": 8})],
    ids=["llama", "mistral-sliding-window"],
)
def test_triton_backend_matches_aten_in_every_phase(
    interpreted_kernels: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arch: str,
    options: dict[str, Any],
) -> None:
    folder = make_tiny_model_dir(tmp_path, arch=arch, num_layers=2, **options)
    aten = scenario_logits(folder, "auto", monkeypatch)
    ours = scenario_logits(folder, "triton", monkeypatch)
    worst: dict[str, float] = {}
    for (phase, *_, expected), (*_, logits) in zip(aten, ours, strict=True):
        worst[phase] = max(worst.get(phase, 0.0), (logits - expected).abs().max().item())
    assert len(worst) == 5, worst  # prefill batch, decode, mixed, mixed with cached context, decode after
    assert max(worst.values()) < 1e-4, worst


def test_unknown_backend_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_attention, "SELECTED", "flash")
    with pytest.raises(ValueError, match="TESSERA_ATTENTION_BACKEND='flash'"):
        triton_attention.uses_triton(CPU)
