"""Gemma 2 and Gemma 3 (text) through Tessera equal transformers' forward: logits in every phase of
the paged scenario, greedy tokens through the engine, and the parallel layouts against one rank.

The tiny models are built so that each Gemma detail shows: sliding layers between full ones with a
window (6) shorter than the scenario's sequences (up to 21 tokens), soft-capping small enough to
bend real scores (Gemma 2: attention 5, logits 3), query_pre_attn_scalar and head_dim (32) other
than hidden_size / heads (16), tied embeddings, and for Gemma 3 two RoPE tables (a linear scaling
on the full layers' only).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tessera import SamplingParams, kernels
from tessera.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tessera.models.hf_config import HFConfig
from tessera.models.loader import load_model
from tests.distributed.equivalence import Workload, compare_prompt_logprobs, run, token_prompts
from tests.distributed.equivalence import compare as compare_greedy
from tests.fixtures.models import make_tiny_model_dir
from tests.models.family_greedy import check_family_greedy
from tests.models.scenario import compare, reference_logits, run_many_decodes, run_scenario

torch.set_num_threads(2)
CPU = torch.device("cpu")
WINDOW = 6
GEMMA_SHAPE = {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "head_dim": 32}
GEMMA2 = {**GEMMA_SHAPE, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}
GEMMA3 = {
    **GEMMA_SHAPE,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
}
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}
VARIANTS: dict[str, dict[str, Any]] = {
    "gemma2": {"arch": "gemma2", "tie": True, "overrides": GEMMA2},
    "gemma3": {"arch": "gemma3", "tie": True, "overrides": GEMMA3, "rope_parameters": GEMMA3_ROPE},
}
PHASES = {"prefill batch", "decode", "mixed", "mixed with cached context", "decode after mixed"}


def tiny_gemma(path: Path, variant: str, **changes: Any) -> Path:
    spec = dict(VARIANTS[variant])
    spec["overrides"] = {**spec["overrides"], **changes}
    return make_tiny_model_dir(path, **spec)


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: tiny_gemma(tmp_path_factory.mktemp(name), name) for name in VARIANTS}


@pytest.fixture(scope="module")
def references(gemma_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {
        name: AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for name, folder in gemma_dirs.items()
    }


@pytest.mark.parametrize("attention_path", ["native-kernels", "aten"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp32_logits_match_in_every_phase(
    monkeypatch: pytest.MonkeyPatch,
    gemma_dirs: dict[str, Path],
    references: dict[str, Any],
    variant: str,
    attention_path: str,
) -> None:
    monkeypatch.setattr(kernels, "ENABLED", attention_path == "native-kernels")
    model = load_model(gemma_dirs[variant], dtype=torch.float32, device=CPU)
    assert model.decoder_stack is None  # Gemma layers run their own modules, never the Llama stack
    assert model.kv_cache_spec == (4, 2, 32)  # head_dim from config.json, not hidden / heads
    driver, records = run_scenario(model, vocab=512)
    worst = compare(records, reference_logits(references[variant], driver))
    assert set(worst) == PHASES
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bf16_runs_close_to_fp32_reference(
    gemma_dirs: dict[str, Path], references: dict[str, Any], variant: str
) -> None:
    """bf16 folds 1 + weight into a bf16 norm weight and rounds the normed rows before scaling
    (the project's RMSNorm), where transformers scales in fp32: close, not equal."""
    model = load_model(gemma_dirs[variant], dtype=torch.bfloat16, device=CPU)
    driver, records = run_scenario(model, vocab=512)
    reference_rows = reference_logits(references[variant], driver)
    assert max(compare(records, reference_rows).values()) < 0.25
    agree = [int(row.argmax()) == int(reference_rows[name][pos].argmax()) for _, name, pos, row in records]
    assert sum(agree) / len(agree) > 0.9


def test_many_decodes_of_varied_length_match(
    monkeypatch: pytest.MonkeyPatch, gemma_dirs: dict[str, Path], references: dict[str, Any]
) -> None:
    """The ATen path's length-grouped decodes with soft-capped scores (written out: no SDPA)."""
    monkeypatch.setattr(kernels, "ENABLED", False)
    model = load_model(gemma_dirs["gemma2"], dtype=torch.float32, device=CPU)
    driver, records, groups = run_many_decodes(model, vocab=512)
    assert groups > 1
    worst = compare(records, reference_logits(references["gemma2"], driver))
    assert max(worst.values()) < 1e-4, worst


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_tokens_match_transformers(gemma_dirs: dict[str, Path], variant: str) -> None:
    report = check_family_greedy(gemma_dirs[variant])
    assert report.identical + len(report.near_ties) == report.requests


def test_softcapping_and_windows_change_the_result(tmp_path: Path) -> None:
    """Guards the variants above against a no-op: each of Gemma 2's soft-caps and its window
    changes the logits, the window only from the position it first hides a key at."""
    base = run_scenario(
        load_model(tiny_gemma(tmp_path / "base", "gemma2"), dtype=torch.float32, device=CPU), 512
    )[1]
    changed: dict[str, dict[str, Any]] = {
        "attn_logit_softcapping": {"attn_logit_softcapping": None},
        "final_logit_softcapping": {"final_logit_softcapping": None},
        "sliding_window": {"sliding_window": 1024},
    }
    for name, change in changed.items():
        model = load_model(tiny_gemma(tmp_path / name, "gemma2", **change), dtype=torch.float32, device=CPU)
        records = run_scenario(model, 512)[1]
        diffs = [(a[2], (a[3] - b[3]).abs().max().item()) for a, b in zip(base, records, strict=True)]
        if name == "sliding_window":
            assert max(d for position, d in diffs if position < WINDOW) < 1e-5, name
            assert max(d for position, d in diffs if position >= WINDOW) > 1e-2, name
        else:
            assert max(d for _, d in diffs) > 1e-2, name


# Concurrent requests under chunked prefill and preemption (as tests/distributed's tiny workload).
LAYOUT_WORKLOAD = Workload(
    prompts=token_prompts(6, vocab=512, min_len=3, max_len=60),
    params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    engine_args={"max_num_batched_tokens": 48, "num_kv_blocks": 12, "max_model_len": 160, "max_num_seqs": 16},
)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tensor_sequence_and_pipeline_parallel_match_one_rank(
    gemma_dirs: dict[str, Path], variant: str
) -> None:
    """TP 2 with sequence parallelism over 2 pipeline stages (real rank processes): heads, the
    embedding's and logits' vocabulary and the tokens split, and each stage's layers keep their
    own windows and RoPE tables."""
    model = str(gemma_dirs[variant])
    reference = run(model, LAYOUT_WORKLOAD)
    assert reference.preemptions > 0, "the workload must preempt"
    layout = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "sequence_parallel": True}
    result = run(model, LAYOUT_WORKLOAD, **layout)
    for near_tie in compare_greedy(reference.outputs, result.outputs, f"{variant} tp2-pp2-sp"):
        print("accepted near-tie:", near_tie)
    compare_prompt_logprobs(reference, result, f"{variant} tp2-pp2-sp")


GEMMA2_CONFIG = {
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping 0.0 is not supported"),
        ({"final_logit_softcapping": -1.0}, "final_logit_softcapping -1.0 is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types .* is not supported"),
        ({"sliding_window": None}, "sliding_window None is not supported"),
    ],
)
def test_a_config_gemma_cannot_honour_is_refused_by_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Gemma2ForCausalLM(HFConfig({**GEMMA2_CONFIG, **fields}), dtype=torch.float32)
    with pytest.raises(ValueError, match=message):
        Gemma3ForCausalLM(
            HFConfig({**GEMMA2_CONFIG, "model_type": "gemma3_text", **fields}), dtype=torch.float32
        )
