"""Leader election's settings, as client-go's `leaderelection` names them (and kube-controller-
manager's `--leader-elect-*` flags): the flags come from these fields (`flags.add_model_flags`),
each field's environment variable gives its default (`kopf run` and tests)."""

from __future__ import annotations

import os
import socket
import uuid

from pydantic import BaseModel, ConfigDict, model_validator

from tessera_operator.config import from_environment, setting

# client-go's JitterFactor: a standby retries after retry_period x [1, 1.2).
JITTER = 1.2


class LeaderElection(BaseModel):
    """leader election (only the leader reconciles and autoscales; every replica serves the webhook)"""

    model_config = ConfigDict(frozen=True)

    leader_elect: bool = setting(
        False,
        "take part in leader election on a Lease before reconciling (needed with more than one replica)",
        "TESSERA_LEADER_ELECT",
    )
    lease_name: str = setting(
        "tessera-operator",
        "the Lease's name",
        "TESSERA_LEADER_ELECT_NAME",
        flag="--leader-elect-resource-name",
    )
    lease_namespace: str | None = setting(
        None,
        "the Lease's namespace (default: the operator's own, or the first watched one)",
        "TESSERA_LEADER_ELECT_NAMESPACE",
        flag="--leader-elect-resource-namespace",
    )
    # The pod's name (the chart sets POD_NAME from the downward API); a random suffix is added,
    # so a restarted container never takes its predecessor's lease for its own.
    leader_identity: str | None = setting(
        None, "this replica's name in holderIdentity (default: $POD_NAME or the host name)",
        "TESSERA_LEADER_ELECT_IDENTITY", flag="--leader-elect-identity",
    )  # fmt: skip
    lease_duration_seconds: float = setting(
        15.0,
        "how long a standby waits, from the last renewal it saw, before it takes the lease",
        "TESSERA_LEADER_ELECT_LEASE_DURATION",
        flag="--leader-elect-lease-duration",
        positive=True,
    )
    renew_deadline_seconds: float = setting(
        10.0,
        "a leader that could not renew for this long stops reconciling (less than the lease duration)",
        "TESSERA_LEADER_ELECT_RENEW_DEADLINE",
        flag="--leader-elect-renew-deadline",
        positive=True,
    )
    retry_period_seconds: float = setting(
        2.0,
        "between renewals, and between a standby's tries",
        "TESSERA_LEADER_ELECT_RETRY_PERIOD",
        flag="--leader-elect-retry-period",
        positive=True,
    )

    @model_validator(mode="after")
    def _ordered(self) -> LeaderElection:
        # The safety argument: the leader stops acting renew_deadline after its last renewal began;
        # a standby takes over no sooner than lease_duration after it saw that renewal.
        if not self.renew_deadline_seconds < self.lease_duration_seconds:
            raise ValueError("the renew deadline must be shorter than the lease duration")
        if not self.retry_period_seconds * JITTER < self.renew_deadline_seconds:
            raise ValueError(f"the renew deadline must exceed {JITTER} x the retry period")
        return self


def from_env() -> LeaderElection:
    return LeaderElection(**from_environment(LeaderElection, os.environ))


def holder_identity(settings: LeaderElection) -> str:
    """`<pod or host name>_<random>`, as client-go's examples make it: unique per process."""
    base = settings.leader_identity or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{base}_{uuid.uuid4().hex[:8]}"


def lease_namespace(settings: LeaderElection, watched: list[str]) -> str:
    """The Lease's namespace: the flag, else the pod's own (its ServiceAccount's), else the first watched."""
    if settings.lease_namespace:
        return settings.lease_namespace
    own = os.environ.get("POD_NAMESPACE")
    if own:
        return own
    sa_namespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.path.exists(sa_namespace):
        with open(sa_namespace) as f:
            return f.read().strip()
    if watched:
        return watched[0]
    raise ValueError("leader election needs the Lease's namespace: --leader-elect-resource-namespace")
