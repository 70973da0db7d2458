"""The shared model cache's runtime side (spec.model.cache): where a conversion goes, the fill's
no-op on a complete folder, the bounded wait of a read-only reader (a real conversion into the
cache, on the local cluster: tests/e2e/test_model_cache_on_cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tessera.models import shared_cache
from tessera.models.conversion import COMPLETE_MARKER, ModelCacheTimeout
from tessera.models.registry import conversion_target, resolve_model


def seal(folder: Path) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / COMPLETE_MARKER).write_text(json.dumps({"files": {"config.json": 2}}))


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF")
    return path


def test_a_gguf_converts_into_the_shared_cache_when_one_is_set(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_MODEL_CACHE", str(tmp_path / "shared"))
    target = conversion_target(str(gguf))
    assert target is not None and target.parent == tmp_path / "shared" / "models"
    assert target.name.startswith("m-")
    assert conversion_target(str(tmp_path)) is None  # a folder is read in place


def test_fill_is_a_no_op_on_a_complete_folder_and_ranks_resolve_it(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TESSERA_MODEL_CACHE", str(tmp_path / "shared"))
    target = conversion_target(str(gguf))
    assert target is not None
    seal(target)
    assert shared_cache.fill(str(gguf)) == target
    assert "complete already: no conversion" in capsys.readouterr().out
    assert resolve_model(str(gguf)) == target


def test_a_reader_of_a_read_only_cache_waits_bounded_then_says_which_step_failed(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    # A read-only mount (root, as these tests may run, writes a 0555 folder): access() says no.
    monkeypatch.setattr("tessera.models.registry.os.access", lambda path, mode: False)
    monkeypatch.setenv("TESSERA_MODEL_CACHE", str(shared))
    monkeypatch.setenv(shared_cache.WAIT_ENV, "0.2")
    with pytest.raises(ModelCacheTimeout, match="model-cache-fill"):
        resolve_model(str(gguf))


def test_wait_times_out_with_the_reason(gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_MODEL_CACHE", str(tmp_path / "shared"))
    with pytest.raises(ModelCacheTimeout, match=r"no \.complete marker"):
        shared_cache.wait(str(gguf), timeout=0.2)
