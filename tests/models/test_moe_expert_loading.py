"""Which expert weights each rank holds and reads: under expert parallelism exactly its own
experts, whole; without it a 1/tp slice of every expert. Fused checkpoints load as per-expert
ones do, and experts that do not spread over the TP ranks are refused before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.models.checkpoint import iterate_lazily
from tessera.models.hf_config import load_hf_config
from tessera.models.layers.moe import GroupedExperts
from tessera.models.loader import load_model, model_class_for, safetensors_files
from tessera.topology import RankPlacement
from tests.fixtures.models import make_tiny_model_dir
from tests.models.paged_harness import PagedDriver

torch.set_num_threads(2)
EXPERTS, TP = 8, 2
OVERRIDES = {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3-moe"), arch="qwen3_moe", overrides=OVERRIDES)


def loaded_unpacked(folder: Path, placement: RankPlacement) -> torch.nn.Module:
    """The rank's model with its checkpoint tensors loaded, before any GEMM repacking (which
    may replace the dense parameters): what the rank materialises from the checkpoint."""
    config = load_hf_config(folder)
    model = model_class_for(config)(config, dtype=torch.float32, placement=placement)
    with torch.no_grad():
        loaded = model.load_weights(iterate_lazily(safetensors_files(folder)))
    assert model.missing_parameters(loaded) == []
    return model


def expert_elements(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_and_reads_its_share_of_the_experts(
    qwen3_moe_dir: Path, expert_parallel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    single = loaded_unpacked(qwen3_moe_dir, RankPlacement())
    read: list[list[int]] = []
    load_expert = GroupedExperts.load_expert

    def recording(self: GroupedExperts, expert: int, part: str, loaded: object) -> str:
        read[-1].append(expert)
        return load_expert(self, expert, part, loaded)  # type: ignore[arg-type]

    monkeypatch.setattr(GroupedExperts, "load_expert", recording)
    for rank in range(TP):
        read.append([])
        placement = RankPlacement(tp_rank=rank, tp_size=TP, expert_parallel=expert_parallel)
        model = loaded_unpacked(qwen3_moe_dir, placement)
        assert expert_elements(model) * TP == expert_elements(single)
        experts = model.model.layers[0].mlp.experts
        layers = len(model.model.layers)
        if expert_parallel:  # whole experts, its own contiguous range, and no other expert read
            mine = range(rank * EXPERTS // TP, (rank + 1) * EXPERTS // TP)
            assert experts.gate_up_proj.shape == (EXPERTS // TP, 2 * 32, 64)
            assert sorted(set(read[-1])) == list(mine) and len(read[-1]) == len(mine) * 3 * layers
            whole = single.model.layers[0].mlp.experts.down_proj.data[mine.start : mine.stop]
            torch.testing.assert_close(experts.down_proj.data, whole, rtol=0, atol=0)
        else:  # every expert, half its intermediate dimension
            assert experts.gate_up_proj.shape == (EXPERTS, 32, 64)
            assert sorted(set(read[-1])) == list(range(EXPERTS))


def test_fused_expert_tensors_load_as_per_expert_ones(qwen3_moe_dir: Path, tmp_path: Path) -> None:
    """transformers' in-memory layout, mlp.experts.gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    fused_dir = tmp_path / "fused"
    shutil.copytree(qwen3_moe_dir, fused_dir)
    tensors = load_file(str(qwen3_moe_dir / "model.safetensors"))
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if ".experts." not in name:
            fused[name] = tensor
    for layer in range(4):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([tensors[f"{prefix}.{e}.gate_proj.weight"], tensors[f"{prefix}.{e}.up_proj.weight"]])
            for e in range(EXPERTS)
        ]
        fused[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{prefix}.down_proj"] = torch.stack(
            [tensors[f"{prefix}.{e}.down_proj.weight"] for e in range(EXPERTS)]
        )
    save_file(fused, str(fused_dir / "model.safetensors"))
    for placement in (
        RankPlacement(),
        RankPlacement(tp_rank=1, tp_size=2),
        RankPlacement(tp_rank=1, tp_size=2, expert_parallel=True),
    ):
        a, b = loaded_unpacked(qwen3_moe_dir, placement), loaded_unpacked(fused_dir, placement)
        for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    prompt = list(range(5, 20))
    per_expert, fused_model = (
        load_model(d, dtype=torch.float32, device="cpu") for d in (qwen3_moe_dir, fused_dir)
    )
    assert torch.equal(
        PagedDriver(per_expert).step([("s", prompt)]), PagedDriver(fused_model).step([("s", prompt)])
    )


def test_experts_not_divisible_by_tp_are_refused_naming_the_field(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(
        tmp_path / "mixtral6",
        arch="mixtral",
        num_layers=2,
        intermediate=32,
        overrides={"num_local_experts": 6, "num_experts_per_tok": 2},
    )
    (folder / "model.safetensors").unlink()  # refused before any weight is looked for
    placement = RankPlacement(tp_rank=0, tp_size=4, expert_parallel=True)
    with pytest.raises(
        ValueError,
        match=r"num_local_experts=6 is not divisible by tensor_parallel_size=4: --enable-expert-parallel",
    ):
        load_model(folder, dtype=torch.float32, device="cpu", placement=placement)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_local_experts"] == 6


def test_expert_intermediate_not_divisible_by_tp_is_refused_naming_the_field(qwen3_moe_dir: Path) -> None:
    """Without EP each expert splits its intermediate dimension over the TP ranks."""
    config = load_hf_config(qwen3_moe_dir)
    config.moe_intermediate_size = 33
    with pytest.raises(
        ValueError, match=r"moe_intermediate_size=33 is not divisible by tensor_parallel_size=2"
    ):
        model_class_for(config)(config, dtype=torch.float32, placement=RankPlacement(tp_size=2, tp_rank=0))
