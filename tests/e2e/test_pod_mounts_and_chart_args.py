"""Unit tests of the node agent's container mounts and the chart operator's host arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e import pod_mounts
from e2e.chart_operator import host_args
from tessera_operator import builders
from tessera_operator.api import InferenceClusterSpec


def rank_pod() -> dict[str, Any]:
    spec = InferenceClusterSpec.model_validate(
        {"model": {"source": "smollm2-135m-instruct"}, "parallelism": {"tensor": 1, "pipeline": 2}}
    )
    return builders.build_group(builders.ClusterRef("c", "ns", "u"), spec, "r", 0)[1]


def test_a_rank_pod_gets_its_emptydirs_a_tmpfs_and_the_prebuilt_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "host-cache"))
    (tmp_path / "host-cache").mkdir()
    pod = rank_pod()
    container = pod["spec"]["containers"][0]
    mounts = {m.target: m for m in pod_mounts.container_mounts(pod, container, tmp_path / "pod")}
    assert mounts[pod_mounts.IMAGE_PREBUILT_DIR] == pod_mounts.Mount(
        pod_mounts.IMAGE_PREBUILT_DIR, str(tmp_path / "host-cache"), read_only=True
    )
    assert mounts["/dev/shm"].source is None  # medium: Memory
    for target in ("/cache", "/tmp"):
        assert Path(mounts[target].source or "").is_dir()
        assert Path(mounts[target].source or "").is_relative_to(tmp_path / "pod")
    # What a write to the read-only root, the emptyDir and the secret volume do in a running
    # container: tests/integration/test_node_agent.py (..._read_only_root_its_secret_volume_...).
    assert pod_mounts.read_only_root(container)


def test_image_folders_under_a_volume_stay_visible_at_their_own_paths() -> None:
    # A checkout (and its venv) under /tmp, and a /tmp emptyDir: the program must still be there.
    mounts = [pod_mounts.Mount("/tmp", "/state/pod/volumes/tmp"), pod_mounts.Mount("/cache", "/state/c")]
    prologue = pod_mounts.mount_prologue(mounts, True, ["/tmp/checkout", "/usr/local/python"])
    aside = prologue.index("mount --bind /tmp/checkout /opt/tessera/host/0")
    volume = prologue.index("mount --bind /state/pod/volumes/tmp /tmp")
    back = prologue.index("mount --bind -o ro /opt/tessera/host/0 /tmp/checkout")
    assert aside < volume < back < prologue.index("remount,bind,ro")
    assert "/usr/local/python" not in prologue  # nothing hides it
    assert set(pod_mounts.image_paths()) >= {str(pod_mounts.PROJECT_ROOT)} or any(
        pod_mounts.PROJECT_ROOT.is_relative_to(path) for path in pod_mounts.image_paths()
    )


def test_a_container_starts_in_its_pod_folder_unless_a_mount_hides_it(tmp_path: Path) -> None:
    pod_dir = tmp_path / "pods" / "ns_p_1"
    assert pod_mounts.working_dir({}, pod_dir, []) == str(pod_dir)
    assert pod_mounts.working_dir({}, pod_dir, [pod_mounts.Mount(str(tmp_path), "/x")]) == "/"
    assert pod_mounts.working_dir({"workingDir": "/w"}, pod_dir, []) == "/w"


def test_the_chart_arguments_are_pointed_at_this_host(tmp_path: Path) -> None:
    chart = [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--webhook-port=9443",
        "--webhook-host=tessera-operator-webhook.tessera-system.svc",
        "--webhook-cert-dir=/tmp/webhook-certs",
        "--webhook-managed=tessera-operator-tessera-system.tessera.dev",
    ]
    args = host_args(chart, 1111, 2222, tmp_path)
    assert args == [
        "--all-namespaces",
        "--liveness=http://127.0.0.1:1111/healthz",
        "--webhook-port=2222",
        "--webhook-host=127.0.0.1",
        f"--webhook-cert-dir={tmp_path}",
        "--webhook-managed=tessera-operator-tessera-system.tessera.dev",
        "--webhook-addr=127.0.0.1",
    ]
