"""The native decoder stack (one call per forward pass) gives the Python layer loop's logits bit
for bit, whichever GEMM backend multiplies the layers (native, or a Python callback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.kernels import native_ops
from tessera.kernels.gemm_selection import FORCE_VARIABLE
from tessera.models.decoder_stack import build_decoder_stack
from tessera.models.llama import LlamaForCausalLM
from tessera.models.loader import load_model
from tessera.topology import RankPlacement
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged_harness import PagedDriver
from tests.models.scenario import run_scenario

torch.set_num_threads(2)
CPU = torch.device("cpu")
VOCAB = 512
VARIANTS = {
    "llama": {"arch": "llama"},
    "qwen2-qkv-bias-tied": {"arch": "qwen2"},
    "mistral-sliding-window": {"arch": "mistral", "sliding_window": 8},
}
pytestmark = pytest.mark.skipif(native_ops(CPU) is None, reason="the native kernels do not build here")


@pytest.fixture(scope="module", params=list(VARIANTS))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def scenario_logits(folder: Path, dtype: torch.dtype, stacked: bool) -> list[torch.Tensor]:
    model = load_model(folder, dtype=dtype, device=CPU)
    assert model.decoder_stack is not None
    if not stacked:
        model.decoder_stack = None  # the Python loop over the layers
    _, records = run_scenario(model, vocab=VOCAB)
    return [logits for *_, logits in records]


# None: the backends measured fastest here; aten: every GEMM a Python callback; panels / mkl:
# the native GEMMs (forced where supported, ATen otherwise).
@pytest.mark.parametrize("backend", [None, "aten", "panels", "mkl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_stack_computes_what_the_layer_loop_computes(
    folder: Path, dtype: torch.dtype, backend: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend is not None:
        monkeypatch.setenv(FORCE_VARIABLE, backend)
    stacked, looped = scenario_logits(folder, dtype, True), scenario_logits(folder, dtype, False)
    assert len(stacked) == len(looped) > 0
    for a, b in zip(stacked, looped, strict=True):
        assert torch.equal(a, b)


def test_a_later_pipeline_stage_takes_the_residual_it_is_handed(tiny_llama_dir: Path) -> None:
    """Stage 1 of 2 starts from the previous stage's hidden states and residual."""
    logits = []
    for stacked in (True, False):
        stages = [
            load_model(
                tiny_llama_dir,
                dtype=torch.float32,
                device=CPU,
                placement=RankPlacement(pp_rank=r, pp_size=2, layer_partition=(2, 2)),
            )
            for r in range(2)
        ]
        if not stacked:
            for stage in stages:
                stage.decoder_stack = None
        drivers = [PagedDriver(stage) for stage in stages]
        with torch.inference_mode():
            for tokens in (list(range(5, 18)), [40], [41]):
                ids, positions, metadata = drivers[0].prepare([("s", tokens)])
                drivers[1].prepare([("s", tokens)])
                handoff = stages[0](ids, positions, drivers[0].kv_caches, metadata)
                hidden = stages[1](None, positions, drivers[1].kv_caches, metadata, handoff)
                logits.append(stages[1].compute_logits(hidden))
    assert all(torch.equal(a, b) for a, b in zip(logits[:3], logits[3:], strict=True))


def test_tensor_parallel_ranks_keep_the_layer_loop(tiny_llama_dir: Path) -> None:
    """Their all-reduces run in Python between the layers' GEMMs."""
    from tessera.models.hf_config import load_hf_config

    model = LlamaForCausalLM(
        load_hf_config(tiny_llama_dir), torch.float32, placement=RankPlacement(tp_rank=0, tp_size=2)
    )
    assert build_decoder_stack(model) is None
