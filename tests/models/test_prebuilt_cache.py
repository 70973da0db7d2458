"""The read-only prebuilt cache (what a runtime image bakes in) is used before building anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tessera import kernels
from tessera.models import registry
from tessera.models.conversion import COMPLETE_MARKER


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
    loaded = kernels._load_prebuilt(key)
    assert loaded is not None and hasattr(loaded, "mkl_linear")
    assert sorted(baked.iterdir()) == [baked / f"tessera_cpu_kernels_{key}.so"]  # no lock, no build files
