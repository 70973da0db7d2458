"""RFC 3339 timestamps as Kubernetes writes them (second precision, UTC, trailing Z)."""

from __future__ import annotations

from datetime import UTC, datetime


def to_rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
