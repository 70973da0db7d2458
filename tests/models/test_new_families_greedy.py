"""Greedy tokens of every family beyond Llama equal transformers' own greedy loop (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.models import make_tiny_model_dir
from tests.models.family_greedy import check_family_greedy
from tests.models.moe_variants import MOE_VARIANTS

FAMILIES = {
    "qwen3": {"arch": "qwen3", "overrides": {"head_dim": 32}},
    "phi3": {"arch": "phi3"},
    **MOE_VARIANTS,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_greedy_equals_transformers(family: str, tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path / family, **FAMILIES[family])
    report = check_family_greedy(folder)
    assert report.identical + len(report.near_ties) == report.requests
