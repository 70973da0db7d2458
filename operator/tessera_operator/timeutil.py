"""Time helpers: RFC 3339 timestamps as Kubernetes writes them (second precision, UTC, trailing Z),
and capped exponential backoff."""

from __future__ import annotations

from datetime import UTC, datetime


def to_rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_rfc3339(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def capped_backoff(attempt: int, base: float, cap: float) -> float:
    """base * 2**(attempt - 1), at most cap; attempt is 1-based. The exponent is bounded first:
    after ~1,000 consecutive failures 2.0**exponent would overflow and raise instead."""
    exponent = min(max(attempt - 1, 0), 62)
    return float(min(base * 2.0**exponent, cap))
