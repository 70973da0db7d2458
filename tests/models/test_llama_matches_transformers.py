"""Tessera's Llama-family forward (Llama, Qwen2, Mistral, Qwen3, Phi-3) over the paged cache
equals transformers' forward, with every RoPE scaling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tessera import kernels
from tessera.models.loader import load_model
from tessera.topology import RankPlacement
from tests.fixtures.models import make_tiny_model_dir
from tests.models.scenario import compare, reference_logits, run_many_decodes, run_scenario

torch.set_num_threads(2)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so the tiny head_dim has low-, medium- and high-frequency bands.
    "original_max_position_embeddings": 64,
}
# The scenario's positions stay below 64 (run_many_decodes reaches 42): original lengths and
# max_position_embeddings are small, so each scaling changes the frequencies there.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 8.0,
    "mscale": 0.9,
    "mscale_all_dim": 0.5,
}
# Dynamic NTK equals the unscaled frequencies within max_position_embeddings, where the context stops.
DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.3 * i for i in range(8)],
    "long_factor": [2.0 + 0.5 * i for i in range(8)],
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama"},
    "qwen2-qkv-bias-tied": {"arch": "qwen2"},
    # The scenario's sequences reach 21 tokens, so an 8-token window masks real keys.
    "mistral-sliding-window": {"arch": "mistral", "sliding_window": 8},
    "llama3-rope-scaling-tied": {"arch": "llama", "tie": True, "rope_parameters": LLAMA3_ROPE},
    # Per-head query/key norms; a head_dim other than hidden / heads.
    "qwen3-qk-norm": {"arch": "qwen3", "overrides": {"head_dim": 32}},
    "qwen3-yarn": {"arch": "qwen3", "overrides": {"head_dim": 32}, "rope_parameters": YARN_ROPE},
    "llama-dynamic-ntk": {"arch": "llama", "max_position": 64, "rope_parameters": DYNAMIC_ROPE},
    # Fused qkv_proj and gate_up_proj tensors; every layer slides (an 8-token window).
    "phi3-fused-sliding-window": {"arch": "phi3", "overrides": {"sliding_window": 8}},
    # Positions stay below original_max_position_embeddings: short_factor, and the attention factor.
    "phi3-longrope": {
        "arch": "phi3",
        "max_position": 128,
        "rope_parameters": LONGROPE,
        "overrides": {"original_max_position_embeddings": 64},
    },
}
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, params=["native-kernels", "aten"])
def attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every comparison runs on the CPU kernels and on the ATen formulation they replace."""
    monkeypatch.setattr(kernels, "ENABLED", request.param == "native-kernels")
    return str(request.param)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    return folder, reference.eval()


def test_fp32_logits_match_in_every_phase(variant: tuple[Path, Any]) -> None:
    folder, reference = variant
    model = load_model(folder, dtype=torch.float32, device=CPU)
    driver, records = run_scenario(model, vocab=reference.config.vocab_size)
    worst = compare(records, reference_logits(reference, driver))
    assert set(worst) == {
        "prefill batch",
        "decode",
        "mixed",
        "mixed with cached context",
        "decode after mixed",
    }
    assert max(worst.values()) < 1e-4, worst


def test_bf16_runs_close_to_fp32_reference(variant: tuple[Path, Any]) -> None:
    folder, reference = variant
    model = load_model(folder, dtype=torch.bfloat16, device=CPU)
    config = reference.config
    assert model.kv_cache_spec == (
        4,
        config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    driver, records = run_scenario(model, vocab=reference.config.vocab_size)
    assert driver.kv_caches[0].dtype == torch.bfloat16
    reference_rows = reference_logits(reference, driver)
    worst = compare(records, reference_rows)
    # bf16 keeps ~3 significant digits; logits here span about +-3.5.
    assert max(worst.values()) < 0.25, worst
    agree = [
        int(logits.argmax()) == int(reference_rows[name][position].argmax())
        for _, name, position, logits in records
    ]
    assert sum(agree) / len(agree) > 0.9


def test_sliding_window_changes_the_result(tmp_path: Path) -> None:
    """Guards the Mistral variant above: the window really masks keys in this scenario."""
    windowed = load_model(
        make_tiny_model_dir(tmp_path / "w", arch="mistral", sliding_window=8), dtype=torch.float32, device=CPU
    )
    full = load_model(make_tiny_model_dir(tmp_path / "f", arch="mistral"), dtype=torch.float32, device=CPU)
    _, with_window = run_scenario(windowed, vocab=512)
    _, without_window = run_scenario(full, vocab=512)
    late = [
        (a[3] - b[3]).abs().max().item()
        for a, b in zip(with_window, without_window, strict=True)
        if a[2] >= 8
    ]
    early = [
        (a[3] - b[3]).abs().max().item() for a, b in zip(with_window, without_window, strict=True) if a[2] < 8
    ]
    assert max(early) < 1e-5 and max(late) > 1e-2


def test_model_interface(tiny_llama_dir: Path) -> None:
    from transformers import AutoConfig

    model = load_model(tiny_llama_dir, dtype=torch.float32, device=CPU)
    config = AutoConfig.from_pretrained(tiny_llama_dir)
    assert model.num_layers == config.num_hidden_layers == 4
    assert model.kv_cache_spec == (
        4,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
    )
    assert model.config.vocab_size == config.vocab_size
    logits = model.compute_logits(torch.zeros(3, config.hidden_size))
    assert logits.shape == (3, config.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize("folder_fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_pipeline_stages_chain_to_the_full_model(folder_fixture: str, request: pytest.FixtureRequest) -> None:
    """Untied (llama) and tied (qwen2: the last stage's LM head loads the embedding matrix)."""
    from tessera.distributed.intermediate_tensors import IntermediateTensors
    from tests.models.paged_harness import PagedDriver

    tiny_llama_dir = request.getfixturevalue(folder_fixture)

    full = load_model(tiny_llama_dir, dtype=torch.float32, device=CPU)
    stages = [
        load_model(
            tiny_llama_dir,
            dtype=torch.float32,
            device=CPU,
            placement=RankPlacement(pp_rank=r, pp_size=2, layer_partition=(1, 3)),
        )
        for r in range(2)
    ]
    assert [s.kv_cache_spec[0] for s in stages] == [1, 3]
    assert stages[0].lm_head is None and stages[1].model.embed_tokens is None
    assert stages[0].model.norm is None

    prompt, follow_up = list(range(5, 18)), [40]
    reference = PagedDriver(full)
    expected = [reference.step([("s", prompt)]), reference.step([("s", follow_up)])]
    drivers = [PagedDriver(stage) for stage in stages]  # same seed: same block placement
    with torch.inference_mode():
        for tokens, want in zip([prompt, follow_up], expected, strict=True):
            ids, positions, metadata = drivers[0].prepare([("s", tokens)])
            drivers[1].prepare([("s", tokens)])
            handoff = stages[0](ids, positions, drivers[0].kv_caches, metadata)
            assert isinstance(handoff, IntermediateTensors) and set(handoff) == {"hidden_states", "residual"}
            hidden = stages[1](None, positions, drivers[1].kv_caches, metadata, handoff)
            assert torch.allclose(stages[1].compute_logits(hidden), want, atol=1e-5)


def test_many_decodes_of_varied_length_match(variant: tuple[Path, Any], attention_path: str) -> None:
    folder, reference = variant
    model = load_model(folder, dtype=torch.float32, device=CPU)
    driver, records, groups = run_many_decodes(model, vocab=reference.config.vocab_size)
    if attention_path == "aten":
        assert groups > 1  # the length-grouped decode path ran
    worst = compare(records, reference_logits(reference, driver))
    assert max(worst.values()) < 1e-4, worst
