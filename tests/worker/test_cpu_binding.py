"""Which CPUs a rank's torch threads are pinned to, and that the pinning really happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tessera.config import EngineConfig
from tessera.kernels import cpu_kernels
from tessera.worker.cpu_binding import choose_cpus, parse_cpus


def test_cpu_lists_parse_like_taskset() -> None:
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpus("5") == [5]
    for bad in ("", "a", "1-", "0,0", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def test_auto_pins_only_an_own_process_that_owns_exactly_its_cpus() -> None:
    four = {0, 1, 2, 3}
    assert choose_cpus("auto", 4, four, own_process=True) == [0, 1, 2, 3]
    # Local ranks share the machine out in local-rank order.
    assert choose_cpus("auto", 2, four, local_rank=1, local_world_size=2, own_process=True) == [2, 3]
    # The caller's own process (the offline LLM): its threads are not ours to move.
    assert choose_cpus("auto", 4, four, own_process=False) is None
    # A pod that sees more CPUs than it uses may share them with neighbours we cannot see.
    assert choose_cpus("auto", 2, four, own_process=True) is None
    assert choose_cpus("none", 4, four, own_process=True) is None


def test_an_explicit_list_pins_anywhere_and_is_checked() -> None:
    assert choose_cpus("2,0", 2, {0, 1, 2}) == [2, 0]
    assert choose_cpus("0-3", 2, {0, 1, 2, 3}, local_rank=1, local_world_size=2) == [2, 3]
    with pytest.raises(ValueError, match="names 3 CPUs for 2 threads"):
        choose_cpus("0-2", 2, {0, 1, 2})
    with pytest.raises(ValueError, match=r"CPUs \[7\] are outside"):
        choose_cpus("0,7", 2, {0, 1})


def test_engine_config_rejects_a_malformed_binding() -> None:
    assert EngineConfig(model="m", cpu_binding="0-1").cpu_binding == "0-1"
    with pytest.raises(ValueError, match="cpu_binding"):
        EngineConfig(model="m", cpu_binding="first two")


@pytest.mark.skipif(cpu_kernels() is None, reason="no C++ toolchain to build the kernels")
def test_threads_are_pinned_one_per_cpu_and_stay_pinned() -> None:
    """In a process of its own (pinning moves the calling thread): every thread of torch's pool
    ends up on its own CPU, and still is after torch has run parallel work."""
    cpus = sorted(os.sched_getaffinity(0))
    script = textwrap.dedent(
        f"""
        import json, os, torch
        from tessera.worker import cpu_binding
        torch.set_num_threads({len(cpus)})
        cpu_binding.OWN_PROCESS = True
        pinned = cpu_binding.bind_threads("auto", {len(cpus)})
        torch.randn(512, 512) @ torch.randn(512, 512)  # parallel work in the same pool
        # A second engine in the same process pins again: the calling thread's narrowed mask
        # must not read as the process's CPUs.
        assert cpu_binding.bind_threads(",".join(map(str, pinned)), {len(cpus)}) == pinned
        masks = []
        for task in os.listdir("/proc/self/task"):
            masks.append(sorted(os.sched_getaffinity(int(task))))
        print(json.dumps({{"pinned": pinned, "masks": masks}}))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["pinned"] == cpus
    single = sorted(mask[0] for mask in report["masks"] if len(mask) == 1)
    assert single == cpus, f"expected one thread pinned to each of {cpus}, got masks {report['masks']}"


def test_a_containers_cpu_limit_caps_the_default_threads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod limited to a few CPUs sees every core of its node: its threads follow the limit."""
    from pathlib import Path

    from tessera import host
    from tessera.worker import worker

    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs: 2 threads never throttle
    assert host.cgroup_cpu_limit(v2) == 2
    (v2 / "cpu.max").write_text("max 100000\n")
    assert host.cgroup_cpu_limit(v2) is None
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert host.cgroup_cpu_limit(v1.parent) == 1  # half a CPU still runs one thread
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert host.cgroup_cpu_limit(v1.parent) is None
    assert host.cgroup_cpu_limit(Path(tmp_path / "none")) is None

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(worker, "PROCESS_CPUS", frozenset(range(64)))
    monkeypatch.setattr(worker, "cgroup_cpu_limit", lambda: 4)
    assert worker.default_num_threads() == 4 and worker.default_num_threads(local_world_size=2) == 2
    monkeypatch.setattr(worker, "cgroup_cpu_limit", lambda: None)
    assert worker.default_num_threads(local_world_size=2) == 32
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker.default_num_threads() == 3
