"""The read-only prebuilt cache (what a runtime image bakes in) is used before building anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tessera import kernels
from tessera.kernels import build
from tessera.models import registry
from tessera.models.conversion import COMPLETE_MARKER
from tessera.topology import RankPlacement


def test_a_complete_prebuilt_model_is_used_without_converting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alias = registry.ALIASES["smollm2-135m-instruct"]
    baked = tmp_path / "image" / "models" / f"smollm2-135m-instruct-{alias.version}"
    baked.mkdir(parents=True)
    (baked / "config.json").write_text("{}")
    (baked / COMPLETE_MARKER).write_text(json.dumps({"files": {"config.json": 2}}))
    monkeypatch.setenv("TESSERA_PREBUILT_CACHE", str(tmp_path / "image"))
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "writable"))
    assert registry.resolve_model("smollm2-135m-instruct") == baked
    assert not (tmp_path / "writable").exists()


def test_an_incomplete_prebuilt_model_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alias = registry.ALIASES["smollm2-135m-instruct"]
    (tmp_path / "image" / "models" / f"smollm2-135m-instruct-{alias.version}").mkdir(parents=True)
    writable = tmp_path / "writable" / "models" / f"smollm2-135m-instruct-{alias.version}"
    writable.mkdir(parents=True)
    (writable / "config.json").write_text("{}")
    (writable / COMPLETE_MARKER).write_text(json.dumps({"files": {"config.json": 2}}))
    monkeypatch.setenv("TESSERA_PREBUILT_CACHE", str(tmp_path / "image"))
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "writable"))
    assert registry.resolve_model("smollm2-135m-instruct") == writable


def test_prebuilt_kernels_load_from_a_read_only_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = kernels.cpu_kernels()
    if built is None:
        pytest.skip("no C++ compiler here")
    key = kernels.build_key()
    baked = tmp_path / "kernels" / key
    baked.mkdir(parents=True)
    assert built.__file__ is not None
    shutil.copy(built.__file__, baked / f"tessera_cpu_kernels_{key}.so")
    baked.chmod(0o555)
    monkeypatch.setenv("TESSERA_PREBUILT_CACHE", str(tmp_path))
    loaded = build.load_prebuilt(key)
    assert loaded is not None and hasattr(loaded, "mkl_linear")
    assert sorted(baked.iterdir()) == [baked / f"tessera_cpu_kernels_{key}.so"]  # no lock, no build files


def test_gemm_verdicts_measured_ahead_serve_a_rank_without_measuring(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    """What images/prebuild_cache.py records for a TP size is exactly what a rank of that size
    looks up: its load then measures nothing and runs the prebuilt verdicts."""
    import torch

    from tessera.kernels import gemm_selection
    from tessera.models.layers.linear import gemm_backend
    from tessera.models.loader import load_model, select_gemm_backends

    baked = tmp_path / "image" / gemm_selection.SELECTION_FILE
    monkeypatch.setattr(gemm_selection, "_unrecorded_verdicts", {})
    monkeypatch.setattr(gemm_selection, "CONTENTION_LIMIT_CPUS", float("inf"))
    monkeypatch.delenv(gemm_selection.FORCE_VARIABLE, raising=False)
    monkeypatch.setattr(gemm_selection, "selection_path", lambda: baked)
    monkeypatch.setattr(gemm_selection, "prebuilt_selection_path", lambda: tmp_path / "none.json")
    ahead = select_gemm_backends(smollm2_dir, dtype=torch.float32, tp_size=3)
    assert set(ahead) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert len(json.loads(baked.read_text())) == 5  # 4 layer shapes (gate_up as SwiGLU) + the LM head
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        select_gemm_backends(smollm2_dir, dtype=torch.float32, tp_size=2)  # 9 heads

    # A rank pod: an empty cache of its own, the image's as its prebuilt cache, no measuring.
    monkeypatch.setattr(
        gemm_selection, "selection_path", lambda: tmp_path / "pod" / gemm_selection.SELECTION_FILE
    )
    monkeypatch.setattr(gemm_selection, "prebuilt_selection_path", lambda: baked)

    def no_measuring(*args: object, **kwargs: object) -> None:
        raise AssertionError("a prebuilt verdict was measured again")

    monkeypatch.setattr(gemm_selection, "measure", no_measuring)
    model = load_model(
        smollm2_dir,
        dtype=torch.float32,
        device="cpu",
        placement=RankPlacement(tp_rank=2, tp_size=3, pp_rank=1, pp_size=2),
    )
    ran = {name.rpartition(".")[2]: gemm_backend(module) for name, module in model.named_modules()}
    assert {layer: ran[layer] for layer in ahead} == ahead
