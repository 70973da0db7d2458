"""The Lease's record and the election's decisions, pure (no API, no clock of their own).

client-go's rules: a replica may take the lease when it is free (no holder), already its own,
or expired: no change of the record seen for leaseDurationSeconds *on this replica's own clock*
(`Observed.at`: when the record last changed as this replica saw it, never the renewTime written
by another node, whose clock may be off). A leader counts its term from the moment it *sent* its
last successful renewal and stops acting renew_deadline later, which is before any standby can
take over (renew_deadline < lease_duration, and the standby saw that renewal no sooner).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

LEASE_API = "/apis/coordination.k8s.io/v1"


def micro_time(epoch: float) -> str:
    """A MicroTime as the API server writes it (RFC 3339, microseconds, UTC)."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(namespace: str, name: str | None = None) -> str:
    path = f"{LEASE_API}/namespaces/{namespace}/leases"
    return f"{path}/{name}" if name else path


@dataclass(frozen=True)
class Record:
    """A Lease's spec, the part the election reads and writes."""

    holder: str = ""  # empty: free (a leader that stopped gracefully released it)
    duration_seconds: int = 0
    acquire_time: str | None = None
    renew_time: str | None = None
    transitions: int = 0

    @classmethod
    def of(cls, lease: dict[str, Any]) -> Record:
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or "",
            duration_seconds=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
            transitions=int(spec.get("leaseTransitions") or 0),
        )

    def spec(self) -> dict[str, Any]:
        return {
            "holderIdentity": self.holder or None,  # null: client-go writes the empty string's absence
            "leaseDurationSeconds": self.duration_seconds,
            "acquireTime": self.acquire_time,
            "renewTime": self.renew_time,
            "leaseTransitions": self.transitions,
        }


@dataclass(frozen=True)
class Observed:
    """The record as this replica last saw it, and when it last changed (its monotonic clock)."""

    record: Record | None  # None: no Lease yet
    at: float


def observe(previous: Observed | None, record: Record | None, now: float) -> Observed:
    """A record unchanged since the last look keeps its time: an expired lease is one nobody renewed."""
    if previous is not None and previous.record == record:
        return previous
    return Observed(record, now)


def may_take(seen: Observed, identity: str, now: float) -> bool:
    """Free, ours, or not renewed for its leaseDurationSeconds as this replica observed it."""
    record = seen.record
    if record is None or not record.holder or record.holder == identity:
        return True
    return now >= seen.at + record.duration_seconds


def claim(record: Record | None, identity: str, wall: float, duration_seconds: int) -> Record:
    """The record this replica writes to acquire or renew: a renewal keeps acquireTime; a new holder
    sets it and counts a transition."""
    stamp = micro_time(wall)
    if record is not None and record.holder == identity:
        return Record(identity, duration_seconds, record.acquire_time or stamp, stamp, record.transitions)
    transitions = record.transitions + 1 if record is not None else 0
    return Record(identity, duration_seconds, stamp, stamp, transitions)


def release(record: Record, wall: float) -> Record:
    """What a leader stopping gracefully writes (client-go's ReleaseOnCancel): no holder and a
    1 s duration, so a standby takes over at its next try instead of after the lease duration."""
    stamp = micro_time(wall)
    return Record("", 1, stamp, stamp, record.transitions)


def leading_until(renewal_sent: float, renew_deadline: float) -> float:
    """The end of a leader's term (monotonic), counted from when its last successful renewal was
    sent: the API server stored it no sooner, so a standby saw it no sooner either."""
    return renewal_sent + renew_deadline
