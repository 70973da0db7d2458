"""The import contracts `make lint` checks catch what they say they catch.

Each breach is planted in a copy of the runtime's sources and lint-imports is run on the copy with
pyproject.toml's own contract, so these tests hold whatever the checkout's imports are today.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
TYPE_CHECKING_IMPORT = "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    import tessera.engine\n"
PLANTED_CIRCLE = {
    "wire/planted_a.py": "from tessera.wire import planted_b\n",
    "wire/planted_b.py": "import tessera.wire.planted_a\n",
}


def run_lint_imports(config: Path, contract: str, sources: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on one contract, importing `tessera` from `sources` (the rest from this checkout)."""
    path = [sources, REPO / "operator", REPO]  # REPO: the contract types in tests/architecture
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, path)), "COLUMNS": "300"}
    command = [str(LINT_IMPORTS), str(config), "--contract", contract, "--no-cache", "--no-logo"]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def runtime_with(tmp_path: Path, plants: dict[str, str]) -> Path:
    """A copy of runtime/tessera's Python files, each planted text appended (its file made if new)."""
    shutil.copytree(REPO / "runtime" / "tessera", tmp_path / "tessera", ignore=not_python)
    for relative, text in plants.items():
        with (tmp_path / "tessera" / relative).open("a") as module:
            module.write("\n" + text)
    return tmp_path


def not_python(folder: str, names: list[str]) -> list[str]:
    return [name for name in names if not name.endswith(".py") and not (Path(folder) / name).is_dir()]


@pytest.mark.parametrize(
    ("contract", "plants", "reported"),
    [
        pytest.param(
            "runtime-layers",
            {"kernels/isa.py": "import tessera.entrypoints.api_server\n"},
            "- tessera.kernels.isa -> tessera.entrypoints.api_server (l.",
            id="upward-import",
        ),
        pytest.param(
            "runtime-layers",
            {"kernels/isa.py": TYPE_CHECKING_IMPORT},
            "- tessera.kernels.isa -> tessera.engine (l.",
            id="upward-import-for-type-checking-only",
        ),
        pytest.param(
            "runtime-layers",
            {"metrics.py": "from tessera import config\n"},
            "- tessera.metrics -> tessera.config (l.",
            id="sibling-import",
        ),
        pytest.param(
            "runtime-layers",
            {"unplaced.py": '"""A module in no layer."""\n'},
            "- tessera.unplaced",
            id="module-in-no-layer",
        ),
        pytest.param(
            "runtime-facade",
            {"kernels/isa.py": "from tessera import __version__\n"},
            "tessera.kernels.isa -> tessera (l.",
            id="import-of-the-facade",
        ),
        pytest.param(
            "acyclic",
            PLANTED_CIRCLE,
            "tessera.wire.planted_a -> tessera.wire.planted_b -> tessera.wire.planted_a",
            id="import-circle",
        ),
    ],
)
def test_a_planted_breach_breaks_the_contract(
    tmp_path: Path, contract: str, plants: dict[str, str], reported: str
) -> None:
    result = run_lint_imports(REPO / "pyproject.toml", contract, runtime_with(tmp_path, plants))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Contracts: 0 kept, 1 broken." in result.stdout
    assert reported in result.stdout


PROBE_CONFIG = """\
[importlinter]
root_packages =
    probe
contract_types =
    acyclic_modules: tests.architecture.acyclic_modules.AcyclicModulesContract

[importlinter:contract:acyclic]
name = No circle in probe
type = acyclic_modules
packages =
    probe
"""


def probe_package(tmp_path: Path, modules: dict[str, str]) -> Path:
    (tmp_path / "probe").mkdir()
    for name, text in {"__init__": "", **modules}.items():
        (tmp_path / "probe" / f"{name}.py").write_text(text)
    (tmp_path / ".importlinter").write_text(PROBE_CONFIG)
    return tmp_path


def test_the_circle_check_keeps_a_package_whose_imports_only_go_one_way(tmp_path: Path) -> None:
    probe = probe_package(tmp_path, {"a": "import probe.b\n", "b": "import probe.c\n", "c": ""})
    result = run_lint_imports(probe / ".importlinter", "acyclic", probe)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 0 broken." in result.stdout


def test_the_circle_check_reports_the_shortest_circle_with_its_import_lines(tmp_path: Path) -> None:
    modules = {
        "a": "import probe.b\n",
        "b": "import probe.c\nimport probe.d\n",
        "c": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from probe import a\n",
        "d": "import probe.c\n",
    }
    result = run_lint_imports(probe_package(tmp_path, modules) / ".importlinter", "acyclic", tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "probe.a -> probe.b -> probe.c -> probe.a" in result.stdout
    assert "- probe.c -> probe.a (l.4)" in result.stdout
    assert "(in the same circles: probe.d)" in result.stdout
