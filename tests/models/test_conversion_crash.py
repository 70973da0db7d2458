"""A converted model is used only when complete: a conversion killed at any point, or weights cut
short after the fact, make the next start convert again instead of loading a broken folder."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tessera.models import conversion

# Runs one conversion in a child process that SIGKILLs itself at the chosen point.
KILLED_CONVERSION = """
import os, signal, sys
from pathlib import Path
from tessera.models import conversion

point, source, target = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def convert(gguf, out):
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"w" * 1000)
    if point == "converting":
        die()

seal = conversion._seal

def seal_then_die(folder):
    seal(folder)
    if point == "sealed":
        die()

conversion._convert = convert
conversion._seal = seal_then_die
conversion.convert_gguf_once(source, target)
"""


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    return source


def fake_convert(calls: list[Path]) -> object:
    def convert(gguf_path: Path, out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    return convert


@pytest.mark.parametrize("point", ["converting", "sealed"])
def test_conversion_killed_midway_is_redone_by_the_next_start(
    point: str, gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "cache" / "model-1"
    child = subprocess.run(
        [sys.executable, "-c", KILLED_CONVERSION, point, str(gguf), str(target)],
        capture_output=True,
        timeout=60,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert not conversion.is_complete(target)
    calls: list[Path] = []
    monkeypatch.setattr(conversion, "_convert", fake_convert(calls))
    assert conversion.convert_gguf_once(gguf, target) == target
    assert len(calls) == 1 and conversion.is_complete(target)
    assert not list(target.parent.glob(".model-1.tmp-*"))
    assert conversion.convert_gguf_once(gguf, target) == target and len(calls) == 1  # cached now


def test_weights_cut_short_after_publishing_are_converted_again(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "cache" / "model-1"
    calls: list[Path] = []
    monkeypatch.setattr(conversion, "_convert", fake_convert(calls))
    conversion.convert_gguf_once(gguf, target)
    with open(target / "model.safetensors", "r+b") as weights:
        weights.truncate(10)
    assert not conversion.is_complete(target)
    conversion.convert_gguf_once(gguf, target)
    assert len(calls) == 2 and (target / "model.safetensors").stat().st_size == 1000


def test_folder_without_marker_is_not_trusted(
    gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a conversion cut short used to leave: config.json present, weights truncated.
    target = tmp_path / "cache" / "model-1"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"w" * 10)
    calls: list[Path] = []
    monkeypatch.setattr(conversion, "_convert", fake_convert(calls))
    conversion.convert_gguf_once(gguf, target)
    assert len(calls) == 1 and conversion.is_complete(target)
    assert (target / "model.safetensors").stat().st_size == 1000
