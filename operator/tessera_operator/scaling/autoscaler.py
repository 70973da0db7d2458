"""Queue-depth autoscaling of replica groups: pure decisions, the rules users know from the HPA.

Each sample is the `tessera:num_requests_waiting` gauge of every Ready leader. The recommendation
is the HPA's for an average-value target: enough groups that each would have `targetQueueDepth`
requests waiting (within a 10% tolerance, no change). While a group cannot be measured (down,
starting, or its leader did not answer) there is no scale-down at all: the HPA counts such pods
as at the target, but a scale-down here removes the highest groups, which may be the ones that
serve while a lower one is down. A scale-down takes the highest recommendation of the stabilization window (a burst's
gap does not drop groups that take a minute to load); a scale-up is immediate but at most doubles
the groups (or adds 4) per decision, as the HPA's default policy does.

With minReplicas 0 the router's own series decide the ends (`RouterSample`): at zero groups, a
request held at the router, or one counted as arrived at zero since the last sample, brings one
group back; the last group goes only once the cluster saw no request for scaleToZeroSeconds (no
new request through the router, none open there, none held, none waiting at a leader). Without
the router's numbers neither happens: a blind autoscaler never removes the last group.

The history lives in the operator's memory, as the HPA's does; a new operator process starts each
cluster's window with its current replicas, so a restart never scales down early.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from tessera_operator.api import AutoscalingSpec

TOLERANCE = 0.1
SCALE_UP_FACTOR = 2
SCALE_UP_MIN_STEP = 4


@dataclass(frozen=True)
class QueueSample:
    """Requests waiting at the leaders that answered, and how many groups did not."""

    waiting: float
    measured: int
    unmeasured: int


@dataclass(frozen=True)
class RouterSample:
    """The router pods' series, summed over the pods that answered: requests held with no group
    Ready, open requests, and the counters of requests routed and of requests that arrived at zero."""

    held: float
    inflight: float
    requests: float
    at_zero: float
    unanswered: int = 0  # Ready router pods that did not answer


@dataclass(frozen=True)
class Decision:
    desired: int
    recommendation: int  # before stabilization and limits
    reason: str


@dataclass
class History:
    """One cluster's past recommendations (time, replicas), oldest first."""

    recommendations: list[tuple[float, int]] = field(default_factory=list)
    last_sample: float | None = None
    blind: bool = False  # Ready leaders exist but none answered the last sample
    last_router: RouterSample | None = None  # the router's counters at the last sample
    active_at: float | None = None  # when the cluster last saw a request (minReplicas 0)

    def record(self, now: float, replicas: int, window: float) -> int:
        """Adds `replicas` and returns the highest recommendation within `window` seconds."""
        self.recommendations = [(t, r) for t, r in self.recommendations if t >= now - window]
        self.recommendations.append((now, replicas))
        return max(r for _, r in self.recommendations)


def parse_gauge(text: str, metric: str) -> float | None:
    """The sum of `metric`'s samples in a Prometheus text exposition, or None if it has none or
    any sample is not a finite count (NaN, +Inf, negative): a queue depth that cannot be."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(metric) or line.startswith("#"):
            continue
        name_end = len(metric)
        if len(line) > name_end and line[name_end] not in " {":
            continue  # another metric whose name starts with this one
        rest = line[name_end:]
        if rest.startswith("{"):
            rest = rest.rsplit("}", 1)[-1]
        value = rest.split()  # the value, then an optional timestamp
        try:
            sample = float(value[0])
        except (IndexError, ValueError):
            continue
        if not math.isfinite(sample) or sample < 0:
            return None
        total += sample
        found = True
    return total if found else None


def sample_of(depths: Mapping[int, float | None], groups: int) -> QueueSample:
    """`depths`: by group index, one per Ready leader (None: no answer); `groups`: spec.replicas.

    Groups past `groups` (a rollout's surge, or ones being removed) add their queues, but never
    stand in for a group below it that is down: that one stays unmeasured.
    """
    measured = [d for d in depths.values() if d is not None]
    unmeasured = sum(1 for index in range(groups) if depths.get(index) is None)
    return QueueSample(sum(measured), len(measured), unmeasured)


def recommend(spec: AutoscalingSpec, current: int, sample: QueueSample) -> tuple[int, str]:
    """Groups wanted for `sample`, before bounds, stabilization and rate limits."""
    target = spec.target_queue_depth
    if sample.measured == 0:
        return current, "no Ready leader to measure"
    average = sample.waiting / sample.measured
    described = (
        f"{sample.waiting:g} requests waiting at {sample.measured} Ready group(s) "
        f"(target {target:g} per group)"
    )
    if abs(average / target - 1) <= TOLERANCE:
        return current, described
    if average > target and sample.unmeasured:
        # As the HPA on a scale-up: groups not measured yet (one still loading, say) count as
        # empty queues, and a ratio that then falls within the tolerance is no change.
        counted = sample.measured + sample.unmeasured
        if sample.waiting / (target * counted) <= 1 + TOLERANCE:
            return current, f"{described}; {sample.unmeasured} group(s) not measured, counted as empty"
    wanted = math.ceil(sample.waiting / target - 1e-9)
    if wanted < current and sample.unmeasured:
        # Scale-down removes the highest groups, Ready or not: with a group down (or silent) it
        # could keep that one and remove the ones serving. Wait until every group is measured.
        return current, f"{described}; {sample.unmeasured} group(s) not measured: no scale-down"
    return wanted, described


def demand_at_zero(router: RouterSample | None, last: RouterSample | None) -> str | None:
    """Why a cluster at zero groups needs one (None: no reason): requests held at the router, or
    arrived there at zero since the last sample (a counter that changed at all: a router pod that
    restarted resets its counters)."""
    if router is None:
        return None
    if router.held > 0:
        return f"{router.held:g} requests held at the router"
    if last is not None and router.at_zero != last.at_zero:
        return "requests arrived at the router with no group Ready"
    return None


def router_activity(
    sample: QueueSample, router: RouterSample | None, last: RouterSample | None
) -> str | None:
    """What shows the cluster is in use now (None: nothing). Unknown (no router sample) counts as
    in use: the last group never goes blind."""
    if router is None or router.unanswered:
        return "the router's metrics are unavailable"
    if (demand := demand_at_zero(router, last)) is not None:
        return demand
    if router.inflight > 0 or sample.waiting > 0:
        return "requests are open"
    if last is None or router.requests != last.requests:
        return "requests went through the router"
    return None


def decide(
    spec: AutoscalingSpec,
    current: int,
    sample: QueueSample,
    history: History,
    now: float,
    router: RouterSample | None = None,
) -> Decision:
    """The replicas to set now; `history` records this recommendation. `router`: the router's
    series, read only with minReplicas 0 (None there: unavailable)."""
    to_zero = spec.min_replicas == 0
    demand = demand_at_zero(router, history.last_router) if to_zero else None
    activity = router_activity(sample, router, history.last_router) if to_zero else None
    if to_zero:
        if router is not None:
            history.last_router = router
        if activity is not None or history.active_at is None:
            history.active_at = now
    if current == 0:
        history.last_sample = now
        if demand is not None:
            history.recommendations = [(now, 1)]  # the new group holds the window from now
            return Decision(1, 1, f"scaling from zero: {demand}")
        # Parked by hand (`kubectl scale --replicas=0`) with minReplicas >= 1: as the HPA, leave it so.
        reason = "scaled to zero: a request at the router brings a group back" if to_zero else ""
        return Decision(0, 0, reason or "scaled to zero: autoscaling waits until replicas are set again")
    decision = _decide_groups(spec, current, sample, history, now)
    if decision.desired == 0:
        assert history.active_at is not None
        idle = now - history.active_at
        if activity is not None or idle < spec.scale_to_zero_seconds:
            why = activity or f"idle {idle:.0f} s of {spec.scale_to_zero_seconds:g}"
            return Decision(1, decision.recommendation, f"{decision.reason}; keeping the last group: {why}")
        return Decision(0, 0, f"no request for {idle:.0f} s: scaling to zero")
    return decision


def _decide_groups(
    spec: AutoscalingSpec, current: int, sample: QueueSample, history: History, now: float
) -> Decision:
    wanted, reason = recommend(spec, current, sample)
    bounded = min(max(wanted, spec.min_replicas), spec.max_replicas)
    stabilized = history.record(now, bounded, spec.scale_down_stabilization_seconds)
    history.last_sample = now
    if bounded > current:
        limit = max(current * SCALE_UP_FACTOR, current + SCALE_UP_MIN_STEP)
        return Decision(min(bounded, limit), wanted, reason)
    # Down only to the window's highest recommendation, and never above maxReplicas.
    desired = max(bounded, min(stabilized, current))
    return Decision(min(desired, spec.max_replicas), wanted, reason)


def seed(history: History, now: float, current: int) -> None:
    """A cluster seen first: its current replicas hold the scale-down window from now."""
    if not history.recommendations:
        history.recommendations.append((now, current))
