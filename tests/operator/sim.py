"""A tiny pure simulation of the API server + kubelet for planner tests (unit tests only).

It applies a Plan's creates/deletes to an in-memory pod set and lets tests play the kubelet
(Running, leader Ready, a container failing). The integration tests use the genuine API server.
"""

from __future__ import annotations

from typing import Any

from tessera_operator import builders
from tessera_operator.api import InferenceClusterSpec, InferenceClusterStatus
from tessera_operator.reconcile.observe import observe, running_revisions
from tessera_operator.reconcile.planner import Plan, plan
from tessera_operator.reconcile.status import build_status

REF = builders.ClusterRef("demo", "ns", "uid-1")


def spec_of(**overrides: Any) -> InferenceClusterSpec:
    raw: dict[str, Any] = {
        "model": {"source": "llama-3.1-8b-instruct"},
        "parallelism": {"tensor": 2, "pipeline": 2},
    }
    raw.update(overrides)
    return InferenceClusterSpec.model_validate(raw)


class Sim:
    def __init__(self, spec: InferenceClusterSpec) -> None:
        self.spec = spec
        self.pods: dict[str, dict[str, Any]] = {}
        self.status = InferenceClusterStatus()
        self.now = 1_000_000.0
        self.last: Plan = Plan()

    def step(self) -> Plan:
        revision = builders.revision_of(self.spec, running_revisions(self.pods.values()))
        obs = observe(REF.name, REF.uid, self.pods.values())
        prior = {g.index: g for g in self.status.groups}
        decision = plan(self.spec, revision, obs, prior, self.now)
        self.status = build_status(
            REF.name, 1, self.spec, revision, decision, "http://x", self.status, self.now
        )
        for name in decision.delete_pods:
            self.pods.pop(name, None)
        for index in decision.create_groups:
            for pod in builders.build_group(REF, self.spec, revision, index):
                self.pods.setdefault(pod["metadata"]["name"], pod)
        self.last = decision
        return decision

    def run_all(self, ready: bool = True) -> None:
        for pod in self.pods.values():
            pod["status"] = {"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}
            if ready and pod["metadata"]["labels"]["tessera.dev/role"] == "leader":
                pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]

    def fail(self, name: str) -> None:
        self.pods[name]["status"] = {
            "phase": "Failed",
            "containerStatuses": [
                {"name": "rank", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}
            ],
        }

    def converge(self, steps: int = 20) -> None:
        """Step and play a healthy kubelet until nothing changes."""
        for _ in range(steps):
            decision = self.step()
            self.run_all()
            if not decision.create_groups and not decision.delete_pods:
                return
        raise AssertionError("did not converge")

    def groups(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        for pod in self.pods.values():
            labels = pod["metadata"]["labels"]
            out.setdefault(int(labels["tessera.dev/group"]), set()).add(labels["tessera.dev/revision"])
        return out

    def condition(self, kind: str) -> Any:
        return next(c for c in self.status.conditions if c.type == kind)
