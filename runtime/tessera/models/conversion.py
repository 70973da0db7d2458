"""Convert a GGUF file once into an ordinary fp32 Hugging Face folder, safely under concurrency.

transformers dequantizes GGUF weights on load but refuses to ``save_pretrained`` such a
model, so the weights are copied into a fresh model built from the same config (without
its ``quantization_config``) and saved as safetensors with the tokenizer and chat template.

The folder survives a kill at any point: work happens in a temporary sibling whose files
are fsynced, then a ``.complete`` marker listing every file and its size is written last,
and the folder is renamed into place. A folder is used only when its marker matches its
files; anything else (a crash, a disk that lost writes, an older layout) is rebuilt. A file
lock makes concurrent processes wait for one conversion instead of racing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".complete"


def is_complete(folder: Path) -> bool:
    """True when ``folder`` holds every file its marker lists, at the listed sizes."""
    try:
        listed = json.loads((folder / COMPLETE_MARKER).read_text())["files"]
        return bool(listed) and all((folder / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def convert_gguf_once(gguf_path: Path, target: Path) -> Path:
    """Return ``target``, converting ``gguf_path`` into it first unless a previous run did."""
    if is_complete(target):
        return target
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process finished while we waited
            return target
        _remove_stale(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert(gguf_path, tmp)
            _make_readable(tmp)
            _seal(tmp)
            os.replace(tmp, target)
            _fsync_path(target.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _make_readable(folder: Path) -> None:
    # mkdtemp creates 0700; the cache is shared by every user and container that mounts it.
    folder.chmod(0o755)
    for item in folder.iterdir():
        item.chmod(0o644)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal(folder: Path) -> None:
    """Flush every file to disk, then write the marker (itself flushed) that makes the folder usable."""
    files = {}
    for item in sorted(folder.iterdir()):
        _fsync_path(item)
        files[item.name] = item.stat().st_size
    marker = folder / COMPLETE_MARKER
    with open(marker, "w") as handle:
        json.dump({"files": files}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    marker.chmod(0o644)
    _fsync_path(folder)


def _remove_stale(target: Path) -> None:
    # Only called under the lock, so no live converter owns these: a crashed run's temporaries,
    # and a target that is not complete (moved aside first, so it is never half-deleted in place).
    if target.exists():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        logger.warning("%s is incomplete (a conversion was interrupted): converting again", target)
        os.replace(target, aside / "old")
    for stale in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ["read tokenizer", "dequantize weights", "copy into a plain model", "write safetensors"]
    started = time.monotonic()
    logger.info("converting %s into %s (once; cached afterwards)", gguf_path.name, out.parent)
    with tqdm(total=len(steps), desc=f"converting {gguf_path.name}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str(steps[1])
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str(steps[2])
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        plain = type(quantized)(config)
        plain.load_state_dict(quantized.state_dict())
        del quantized
        bar.update()
        bar.set_postfix_str(steps[3])
        plain.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        bar.update()
    logger.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - started)


# --- the shared model cache (tessera.models.shared_cache): its readers wait for the marker ---
WAIT_ENV = "TESSERA_MODEL_CACHE_WAIT_SECONDS"
DEFAULT_WAIT_SECONDS = 1800.0
POLL_SECONDS = 1.0


class ModelCacheTimeout(RuntimeError):
    """The fill did not complete within the bound."""


def wait_seconds() -> float:
    return float(os.environ.get(WAIT_ENV) or DEFAULT_WAIT_SECONDS)


def wait_for_fill(target: Path, timeout: float | None = None) -> Path:
    """``target`` once its marker is complete; ModelCacheTimeout after ``timeout`` seconds."""
    timeout = wait_seconds() if timeout is None else timeout
    deadline = time.monotonic() + timeout
    while not is_complete(target):
        if time.monotonic() >= deadline:
            raise ModelCacheTimeout(
                f"the shared model cache has no complete {target} after {timeout:g} s (no "
                ".complete marker): the fill step of the group's leader pod (init container "
                "model-cache-fill) failed or is still running; see its log"
            )
        time.sleep(POLL_SECONDS)
    return target
