"""A worker pod of several ranks (spec.template.ranksPerPod) lives and dies as one: its command
starts one rank process per local rank, each with its own rank's environment, and exits non-zero
promptly when one of them exits; its SIGTERM reaches every one. No leader is needed: the ranks
wait for it (the pod's processes are the operator's own pod spec, run on loopback)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tessera_operator.api import InferenceClusterSpec
from tests.distributed.rank_processes import (
    children_of,
    cmdline,
    group_pods,
    kill_all,
    loopback_env,
    pod_process,
)

PROMPT_EXIT_S = 5.0
SPEC = InferenceClusterSpec.model_validate(
    {"model": {"source": "m"}, "parallelism": {"tensor": 2, "pipeline": 2}, "template": {"ranksPerPod": 2}}
)


def rank_environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def started_ranks(pod: subprocess.Popen[bytes], count: int) -> list[int]:
    """The pod command's rank processes, once all ``count`` have started."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ranks = [pid for pid in children_of(pod.pid) if b"worker" in cmdline(pid)]
        if len(ranks) == count:
            return ranks
        assert pod.poll() is None, f"the pod command exited with {pod.returncode}"
        time.sleep(0.1)
    raise AssertionError(f"the pod command did not start {count} rank processes")


def exit_status_within(proc: subprocess.Popen[bytes], timeout_s: float) -> int | None:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.parametrize("fault", ["a rank dies", "SIGTERM"])
def test_a_pod_of_several_ranks_exits_as_one(tmp_path: Path, fault: str) -> None:
    worker_pod = group_pods(SPEC)[1]  # stage 1: ranks 2 and 3
    pod = pod_process(worker_pod, loopback_env(tmp_path), tmp_path)
    try:
        ranks = started_ranks(pod, 2)
        environs = sorted((rank_environ(pid) for pid in ranks), key=lambda e: e["TESSERA_RANK"])
        assert [(e["TESSERA_RANK"], e["TESSERA_TP_RANK"], e["LOCAL_RANK"]) for e in environs] == [
            ("2", "0", "0"),
            ("3", "1", "1"),
        ]
        assert all(e["TESSERA_LOCAL_WORLD_SIZE"] == "2" and "TESSERA_LOCAL_RANKS" not in e for e in environs)
        if fault == "a rank dies":
            os.kill(ranks[1], signal.SIGKILL)
        else:
            pod.send_signal(signal.SIGTERM)
        status = exit_status_within(pod, PROMPT_EXIT_S)
        assert status is not None and status != 0, f"the pod command's status {PROMPT_EXIT_S} s on: {status}"
        assert status == (137 if fault == "a rank dies" else 128 + signal.SIGTERM)
        assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists() and b"worker" in cmdline(pid)]
    finally:
        kill_all([pod])
        print((tmp_path / f"{worker_pod['metadata']['name']}.log").read_text()[-3000:])


def test_a_pod_runs_ranks_of_one_stage_only_and_the_error_names_the_variable() -> None:
    from tessera.topology import ParallelLayout, Topology, TopologyError

    stage_1 = Topology(layout=ParallelLayout(tensor_parallel_size=2, pipeline_parallel_size=2), pp_rank=1)
    assert stage_1.local_ranks({}) == [2] and stage_1.local_ranks({"TESSERA_LOCAL_RANKS": "2"}) == [2, 3]
    with pytest.raises(TopologyError, match=r"TESSERA_LOCAL_RANKS=3 .*TESSERA_TP_SIZE=2"):
        stage_1.local_ranks({"TESSERA_LOCAL_RANKS": "3"})
    with pytest.raises(TopologyError, match="TESSERA_LOCAL_RANKS must be >= 1"):
        stage_1.local_ranks({"TESSERA_LOCAL_RANKS": "0"})
