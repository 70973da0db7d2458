"""Mixtral, Qwen2-MoE and Qwen3-MoE over the paged cache equal transformers' forward in every
phase (fp32, native kernels and ATen paths), and their experts run only on the rows routed to them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tessera import kernels
from tessera.models.layers.moe import GroupedExperts, MoeSpec, Router, routed_experts
from tessera.models.loader import load_model
from tessera.topology import SINGLE_RANK
from tests.fixtures.models import make_tiny_model_dir
from tests.models.moe_variants import MOE_VARIANTS
from tests.models.scenario import compare, reference_logits, run_scenario

torch.set_num_threads(2)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=list(MOE_VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), **MOE_VARIANTS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return folder, reference.eval()


@pytest.mark.parametrize("attention_path", ["native-kernels", "aten"])
def test_fp32_logits_match_in_every_phase(
    variant: tuple[Path, Any], attention_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kernels, "ENABLED", attention_path == "native-kernels")
    folder, reference = variant
    model = load_model(folder, dtype=torch.float32, device=CPU)
    assert model.decoder_stack is None  # MoE layers run module by module
    driver, records = run_scenario(model, vocab=reference.config.vocab_size)
    worst = compare(records, reference_logits(reference, driver))
    assert len(worst) == 5 and max(worst.values()) < 1e-4, worst


def test_sparse_and_dense_layers_as_the_config_says(variant: tuple[Path, Any]) -> None:
    folder, reference = variant
    model = load_model(folder, dtype=torch.float32, device=CPU)
    ours = [type(layer.mlp).__name__ for layer in model.model.layers]
    theirs = [
        "SparseMoeBlock" if "Sparse" in type(layer.mlp).__name__ else "LlamaMLP"
        for layer in reference.model.layers
    ]
    assert ours == theirs
    assert ("LlamaMLP" in ours) == (reference.config.model_type != "mixtral")  # the dense layers exist


def tiny_experts(num_experts: int = 8, hidden: int = 16, inter: int = 8) -> tuple[Router, GroupedExperts]:
    spec = MoeSpec(num_experts, 2, inter, renormalize=True, weights_in_model_dtype=True)
    router, experts = (
        Router(hidden, spec, torch.float32),
        GroupedExperts(hidden, spec, torch.float32, SINGLE_RANK),
    )
    generator = torch.Generator().manual_seed(0)
    for param in (router.weight, experts.gate_up_proj, experts.down_proj):
        param.data.copy_(torch.randn(param.shape, generator=generator))
    return router, experts


def test_only_routed_experts_run_on_their_rows_and_grouping_equals_a_dense_sum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    router, experts = tiny_experts()
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(1))
    # Route to a few experts only: an untouched expert must not run at all.
    x[:, 0] = 5.0
    router.weight.data[5:, 0] = -50.0
    ids, weights = router.route(x)
    calls: list[tuple[int, int]] = []
    run = experts.expert_forward
    monkeypatch.setattr(
        experts, "expert_forward", lambda e, rows: calls.append((e, rows.shape[0])) or run(e, rows)
    )
    got = routed_experts(x, experts, ids, weights, exchange=False)
    histogram = torch.bincount(ids.reshape(-1), minlength=8)
    assert calls == [(e, int(n)) for e, n in enumerate(histogram.tolist()) if n]
    assert {e for e, _ in calls} <= {0, 1, 2, 3, 4}
    dense = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(2):
            expert = int(ids[token, slot])
            dense[token] += weights[token, slot] * run(expert, x[token : token + 1])[0]
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
