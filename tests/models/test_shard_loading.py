"""A rank reads only its slices of the checkpoint: its share of each TP-split matrix, and nothing
of other pipeline stages' layers."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tessera.models import checkpoint
from tessera.models.loader import UnsupportedModelError, load_model, safetensors_files
from tessera.topology import RankPlacement


def checkpoint_bytes(folder: Path) -> int:
    return sum(t.materialize().nbytes for _, t in checkpoint.iterate_lazily(safetensors_files(folder)))


def bytes_read_loading(folder: Path, **rank: int) -> int:
    before = checkpoint.BYTES_READ.bytes
    load_model(folder, dtype=torch.float32, device="cpu", placement=RankPlacement(**rank))
    return checkpoint.BYTES_READ.bytes - before


@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_tensor_parallel_rank_reads_about_its_share(tiny_llama_dir: Path, tp_size: int) -> None:
    whole = checkpoint_bytes(tiny_llama_dir)
    assert bytes_read_loading(tiny_llama_dir) == whole
    read = bytes_read_loading(tiny_llama_dir, tp_rank=tp_size - 1, tp_size=tp_size)
    # Norm weights are replicated, and with 2 KV heads over 4 ranks each KV head twice: a little
    # over 1/tp, far under the whole.
    assert whole / tp_size <= read < whole / tp_size * 1.35


def test_a_pipeline_stage_never_reads_other_stages_layers(tiny_llama_dir: Path) -> None:
    whole = checkpoint_bytes(tiny_llama_dir)
    first = bytes_read_loading(tiny_llama_dir, pp_rank=0, pp_size=2)
    last = bytes_read_loading(tiny_llama_dir, pp_rank=1, pp_size=2)
    # Every tensor is read by exactly one stage (this model's LM head is not tied to the embedding).
    assert first + last == whole and first < whole * 0.6 and last < whole * 0.6


def rewrite_checkpoint(source: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of `source` whose tensors `edit` changed (in one model.safetensors)."""
    shutil.copytree(source, target)
    tensors = {name: t.materialize() for name, t in checkpoint.iterate_lazily(safetensors_files(target))}
    for path in safetensors_files(target):
        path.unlink()
    (target / "model.safetensors.index.json").unlink(missing_ok=True)
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


def test_a_fused_parameter_missing_a_part_is_reported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # k_proj alone gone: q and v arrive, so qkv_proj would otherwise pass with uninitialised rows.
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.0.self_attn.k_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]

    folder = rewrite_checkpoint(tiny_llama_dir, tmp_path / "partial", drop)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "lacks tensors for: model.layers.0.self_attn.qkv_proj.weight, model.layers.1.mlp.gate_up_proj.weight"
        ),
    ):
        load_model(folder, dtype=torch.float32, device="cpu")


def test_tensors_the_model_has_no_place_for_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    # Biases the config leaves out (attention_bias is false) would otherwise vanish silently.
    def add_bias(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(
            tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
        )

    folder = rewrite_checkpoint(tiny_llama_dir, tmp_path / "extra", add_bias)
    with pytest.raises(
        ValueError, match=re.escape("no place in this LlamaForCausalLM: model.layers.0.self_attn.q_proj.bias")
    ):
        load_model(folder, dtype=torch.float32, device="cpu")
    # ... while every stage of a pipeline skips what other stages hold, without complaint.
    for pp_rank in range(2):
        load_model(
            tiny_llama_dir,
            dtype=torch.float32,
            device="cpu",
            placement=RankPlacement(pp_rank=pp_rank, pp_size=2),
        )


def test_a_stray_safetensors_file_beside_model_safetensors_is_not_read(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """As transformers: without an index, model.safetensors is the checkpoint (a Mistral repo also
    ships its own consolidated.safetensors, in names no Hugging Face model has)."""
    folder = tmp_path / "with-stray"
    shutil.copytree(tiny_llama_dir, folder)
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)}, str(folder / "consolidated.safetensors"))
    assert safetensors_files(folder) == [folder / "model.safetensors"]
    load_model(folder, dtype=torch.float32, device="cpu")


def test_a_quantized_checkpoint_is_refused_by_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "fp8"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"quantized checkpoint \(fp8\)"):
        load_model(folder, dtype=torch.float32, device="cpu")


def edit_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("changes", "tensor"),
    [
        # Smaller layers in config.json than in the checkpoint: a rank's slice would fit, cut from
        # a tensor that is not this model's (transformers refuses the same folders).
        ({"intermediate_size": 32}, "model.layers.0.mlp."),
        ({"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight"),
        ({"num_hidden_layers": 1}, "model.layers.1."),  # a layer past the last one has no place
    ],
)
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_checkpoint_larger_than_its_config_is_refused_naming_the_tensor(
    tiny_llama_dir: Path, tmp_path: Path, changes: dict[str, int], tensor: str, tp_size: int
) -> None:
    folder = edit_config(tiny_llama_dir, tmp_path / "mismatch", **changes)
    with pytest.raises(ValueError, match=re.escape(tensor)):
        load_model(
            folder,
            dtype=torch.float32,
            device="cpu",
            placement=RankPlacement(tp_rank=tp_size - 1, tp_size=tp_size),
        )


def test_a_norm_weight_of_another_shape_is_refused_not_broadcast(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:1].clone()

    folder = rewrite_checkpoint(tiny_llama_dir, tmp_path / "norm", shrink)
    with pytest.raises(ValueError, match=re.escape("model.norm.weight: checkpoint tensor of shape (1,)")):
        load_model(folder, dtype=torch.float32, device="cpu")
