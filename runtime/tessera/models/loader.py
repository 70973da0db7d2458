"""Build a model from a Hugging Face folder and stream its safetensors weights into it.

Neither the config (``hf_config``) nor the forward pass comes from transformers. Tensors are
read lazily (memory-mapped): each parameter's ``weight_loader`` reads only this rank's slice of
its checkpoint tensor, and layers of other pipeline stages are never read at all.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from tessera.models.checkpoint import iterate_lazily
from tessera.models.decoder_stack import build_decoder_stack
from tessera.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from tessera.models.hf_config import HFConfig, UnsupportedModelError, load_hf_config
from tessera.models.layers.linear import gemm_backend, process_weights_after_loading
from tessera.models.llama import LlamaForCausalLM
from tessera.models.mixtral import MixtralForCausalLM
from tessera.models.phi3 import Phi3ForCausalLM
from tessera.models.qwen3 import Qwen3ForCausalLM
from tessera.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tessera.models.support import check_model_folder, supported_architecture
from tessera.topology import SINGLE_RANK, RankPlacement

logger = logging.getLogger(__name__)

# Architectures (config.json "architectures") this implementation runs.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MinistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
__all__ = [
    "MODEL_CLASSES",
    "UnsupportedModelError",
    "load_model",
    "model_class_for",
    "safetensors_files",
    "select_gemm_backends",
]


def model_class_for(config: HFConfig) -> type[LlamaForCausalLM]:
    return MODEL_CLASSES[supported_architecture(config)]


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    if (folder / "model.safetensors").is_file():  # as transformers: not a stray file beside it
        return [folder / "model.safetensors"]  # (e.g. Mistral's own consolidated.safetensors)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    return files


def load_model(
    folder: Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    placement: RankPlacement = SINGLE_RANK,
) -> LlamaForCausalLM:
    """This rank's part of the model in ``folder`` (``placement``: which part), on ``device`` in
    ``dtype``, ready for inference."""
    started = time.monotonic()
    folder = Path(folder)
    device = torch.device(device)
    config = check_model_folder(folder)
    model_class = model_class_for(config)
    with torch.device(device):
        model = model_class(config, dtype=dtype, placement=placement)
    with torch.no_grad():
        loaded = model.load_weights(iterate_lazily(safetensors_files(folder)))
    missing = model.missing_parameters(loaded)
    if missing:
        raise ValueError(f"checkpoint in {folder} lacks tensors for: {', '.join(missing[:8])}")
    model.eval()
    process_weights_after_loading(model)
    model.decoder_stack = build_decoder_stack(model)
    start, end = model.layer_range
    logger.info(
        "loaded %s layers [%d, %d) of %d (tp %d/%d) as %s on %s in %.1f s",
        folder.name,
        start,
        end,
        model.num_layers,
        placement.tp_rank,
        placement.tp_size,
        dtype,
        device,
        time.monotonic() - started,
    )
    return model


def select_gemm_backends(folder: Path, *, dtype: torch.dtype, tp_size: int = 1) -> dict[str, str]:
    """Measures (and records) the GEMM backends of the weights one CPU rank of ``tp_size`` holds
    for the model in ``folder``, as ``load_model`` would: one decoder layer and the LM head, built
    by the model's own classes on random weights (the backends' speed depends on shapes, not
    values). What an image bakes in beside its kernels: rank pods starting together on one node
    otherwise measure while the others load, and such timings are noise (on 2 cores, in two demo
    starts 3 and 4 of the 6 ranks ran some layer on another backend than the rest). Returns
    each layer's backend (``gemm_backend``); ValueError for a ``tp_size`` the model does not split over."""
    config: Any = copy.copy(load_hf_config(folder))  # config.json's fields are its attributes
    config.num_hidden_layers = 1  # every layer has the same shapes
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]  # (their attention kinds differ, not their weights)
    model = model_class_for(config)(config, dtype=dtype, placement=RankPlacement(tp_size=tp_size))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # not torch.empty's garbage: denormals time slower
            parameter.copy_(torch.randn(parameter.shape, generator=generator).mul_(0.02))
    process_weights_after_loading(model)
    return {
        name.rpartition(".")[2]: backend
        for name, module in model.named_modules()
        if (backend := gemm_backend(module)) is not None
    }
