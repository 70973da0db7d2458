"""Two operator replicas on one Lease, against the genuine API server: one acts, a standby takes
over from a killed leader within the lease duration (at once from one that stops gracefully), and
a leader cut off from the API stops acting before the standby starts. Short durations here:
lease 4 s, renew deadline 3 s, retry 1 s (the chart's defaults are 15/10/2)."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from tests.integration.operator_harness import (
    OperatorProcess,
    apply_example,
    install_rbac,
    kjson,
    pod_names,
    pods,
    wait_for,
)
from tests.integration.tcp_proxy import TcpProxy

SMALL = {"tensor": 3, "pipeline": 2}  # 6 pods a group
LEASE_S, RENEW_S, RETRY_S = 4, 3, 1
JITTER = 1.2
# A reconcile pass's own log lines ("ns/name: ..."), as only an acting replica writes them.
ACTING = re.compile(r"tessera_operator\.reconcile\.reconciler: ")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def elected(cluster: Any, ns: str, kubeconfig: str, identity: str) -> OperatorProcess:
    return OperatorProcess(
        cluster,
        ns,
        kubeconfig,
        "--leader-elect",
        f"--leader-elect-resource-namespace={ns}",
        f"--leader-elect-resource-name={lease_name(ns)}",  # as the chart names it: RBAC allows that one
        f"--leader-elect-identity={identity}",
        f"--leader-elect-lease-duration={LEASE_S}",
        f"--leader-elect-renew-deadline={RENEW_S}",
        f"--leader-elect-retry-period={RETRY_S}",
    )


@contextmanager
def replicas(*operators: OperatorProcess) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for op in operators:
            print(f"---- operator log {op.args[-4]} ----\n" + op.log())
        raise
    finally:
        for op in operators:
            op.stop()
            op.log_path.unlink(missing_ok=True)


def lease_name(ns: str) -> str:
    return f"{ns}-operator"  # the chart's fullname for a release named after the namespace


def lease_spec(cluster: Any, ns: str) -> dict[str, Any]:
    return dict(kjson(cluster, "get", "lease", lease_name(ns), "-n", ns)["spec"])


def holder(cluster: Any, ns: str) -> str:
    return str(lease_spec(cluster, ns).get("holderIdentity") or "")


def leadership(op: OperatorProcess) -> dict[str, Any]:
    """The health endpoint's view (kopf caches it for up to 10 s: for what does not change)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{op.health_port}/healthz", timeout=2) as r:
        return dict(json.load(r)["leadership"])


def lines(op: OperatorProcess, message: str) -> list[str]:
    return [line for line in op.log_path.read_text(errors="replace").splitlines() if message in line]


def writes_sent(op: OperatorProcess) -> list[int]:
    """The reconciler's write counts, as logged when a term ends and at shutdown."""
    return [
        int(m.group(1)) for line in lines(op, "writes sent") if (m := re.search(r"(\d+) writes sent", line))
    ]


def acting_lines(op: OperatorProcess) -> list[str]:
    return [line for line in op.log_path.read_text(errors="replace").splitlines() if ACTING.search(line)]


def logged_at(op: OperatorProcess, message: str) -> float:
    """The wall time of the first log line with `message` (the processes share this host's clock)."""
    for line in op.log_path.read_text(errors="replace").splitlines():
        if message in line and (stamp := STAMP.match(line)):
            return datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    raise AssertionError(f"no {message!r} in the log:\n{op.log()}")


def scale(cluster: Any, ns: str, replicas: int) -> None:
    cluster.kubectl(
        "patch",
        "ic",
        "smollm2",
        "-n",
        ns,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"replicas": replicas}}),
    )


def rbac(cluster: Any, ns: str) -> str:
    return install_rbac(cluster, ns, ns, templates=("leader-election-rbac.yaml",))


def test_only_the_leader_acts_and_a_standby_takes_over_from_a_killed_one(
    crds: Any, k8s_namespace: str
) -> None:
    cluster, ns = crds, k8s_namespace
    kubeconfig = rbac(cluster, ns)
    a = elected(cluster, ns, kubeconfig, "op-a")
    b = elected(cluster, ns, kubeconfig, "op-b")
    c = elected(cluster, ns, kubeconfig, "op-c")
    with replicas(a, b, c):
        a.start()
        wait_for(lambda: holder(cluster, ns).startswith("op-a_"), "op-a to take the lease", timeout=10)
        b.start()
        apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL)
        wait_for(lambda: len(pod_names(cluster, ns)) == 6, "group 0's pods")
        uids = {p["metadata"]["uid"] for p in pods(cluster, ns)}
        time.sleep(3)  # a resync (2 s) of each replica: the standby still does nothing
        assert {p["metadata"]["uid"] for p in pods(cluster, ns)} == uids
        # The standby never led, so its reconciler (whose every write needs a term) sent nothing.
        assert lines(a, "became the leader") and not lines(b, "became the leader")
        assert leadership(b)["identity"] != holder(cluster, ns) == leadership(a)["identity"]
        assert not acting_lines(b), acting_lines(b)

        assert a.proc is not None
        a.proc.kill()  # SIGKILL: no release, the standby waits out the lease
        killed, killed_wall = time.monotonic(), time.time()
        scale(cluster, ns, 2)
        wait_for(lambda: len(pod_names(cluster, ns)) == 12, "the standby to add group 1", timeout=20)
        took = time.monotonic() - killed
        # It leads within the lease duration of the last renewal it saw (no later than the kill),
        # plus one jittered retry; then it acts on the change at once.
        took_over = logged_at(b, "became the leader") - killed_wall
        assert took_over < LEASE_S + RETRY_S * JITTER + 1.0, took_over
        assert holder(cluster, ns).startswith("op-b_") and lease_spec(cluster, ns)["leaseTransitions"] >= 1
        assert lines(b, "became the leader")
        print(f"killed leader -> standby leads {took_over:.1f} s, has made group 1's pods {took:.1f} s")

        # A leader that stops gracefully releases the lease: its standby takes over at once.
        c.start()
        wait_for(lambda: leadership(c)["holder"].startswith("op-b_"), "op-c to see op-b lead")
        stopping = time.monotonic()
        b.stop()  # SIGTERM
        wait_for(
            lambda: holder(cluster, ns).startswith("op-c_"),
            "op-c to take the released lease",
            timeout=LEASE_S,
        )
        handover = time.monotonic() - stopping
        assert handover < LEASE_S, handover
        assert lines(b, "released lease") and writes_sent(b)[-1] > 0
        scale(cluster, ns, 1)
        wait_for(lambda: len(pod_names(cluster, ns)) == 6, "the new leader to remove group 1")
        print(f"SIGTERM to the leader -> standby holds the lease: {handover:.1f} s")


def test_a_partitioned_leader_stops_acting_before_the_standby_starts(
    crds: Any, k8s_namespace: str, tmp_path: Path
) -> None:
    cluster, ns = crds, k8s_namespace
    kubeconfig = rbac(cluster, ns)
    api = urlsplit(cluster.api_url)
    with TcpProxy(api.hostname or "127.0.0.1", api.port or 443) as proxy:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
        cut_off = tmp_path / "through-the-proxy.kubeconfig"
        cut_off.write_text(yaml.safe_dump(config))
        a = elected(cluster, ns, str(cut_off), "op-a")
        b = elected(cluster, ns, kubeconfig, "op-b")
        with replicas(a, b):
            a.start()
            wait_for(lambda: holder(cluster, ns).startswith("op-a_"), "op-a to take the lease", timeout=10)
            b.start()
            apply_example(cluster, ns, "smollm2.yaml", parallelism=SMALL)
            wait_for(lambda: len(pod_names(cluster, ns)) == 6, "group 0's pods")

            proxy.cut()
            cut = time.time()
            scale(cluster, ns, 2)  # the leader cannot see it; the standby acts on it once it leads
            wait_for(lambda: len(pod_names(cluster, ns)) == 12, "the standby to add group 1", timeout=15)
            assert holder(cluster, ns).startswith("op-b_")
            stopped = logged_at(a, "stopped leading")
            began = logged_at(b, "became the leader")
            acquired = datetime.fromisoformat(lease_spec(cluster, ns)["acquireTime"].replace("Z", "+00:00"))
            # The cut leader stopped within its renew deadline (plus a retry) of the cut, and
            # before the standby took the lease: never two acting at once.
            assert stopped - cut < RENEW_S + RETRY_S * JITTER + 0.5, stopped - cut
            assert stopped < began and stopped < acquired.timestamp(), (stopped, began, acquired)
            print(
                f"cut -> old leader stopped {stopped - cut:.1f} s; standby took over {began - stopped:.1f} s later"
            )

            # Healed, the old leader finds the lease held and stays a standby: it sends no write
            # after its term (its count when the term ended is its count at shutdown).
            proxy.heal()
            time.sleep(LEASE_S)
            assert len(lines(a, "became the leader")) == 1
            a.stop()
            [at_stop, at_shutdown] = writes_sent(a)
            assert at_stop == at_shutdown > 0, writes_sent(a)
            assert holder(cluster, ns).startswith("op-b_")
