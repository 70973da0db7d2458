"""The scaling step of a pass, pure: when to sample next, and from the Ready leaders' queue
depths the replicas to set, what to say about it, and what status records. The reconciler
reads the depths (queue_metrics) and applies the plan through the scale subresource.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tessera_operator.api import AutoscalingSpec, AutoscalingStatus
from tessera_operator.scaling.autoscaler import (
    Decision,
    History,
    QueueSample,
    RouterSample,
    decide,
    sample_of,
)
from tessera_operator.timeutil import to_rfc3339

SCALED_UP, SCALED_DOWN, METRICS_UNAVAILABLE = "ScaledUp", "ScaledDown", "MetricsUnavailable"


@dataclass(frozen=True)
class ScalePlan:
    replicas: int  # spec.replicas as read
    decision: Decision
    sample: QueueSample
    blind: bool  # Ready leaders exist but none answered
    blind_warning: str | None  # said once, when the blindness starts

    @property
    def scales(self) -> bool:
        return self.decision.desired != self.replicas

    def event(self) -> tuple[str, str]:
        """The (reason, message) of the Event a successful scale posts."""
        verb = SCALED_UP if self.decision.desired > self.replicas else SCALED_DOWN
        return verb, f"replicas {self.replicas} -> {self.decision.desired}: {self.decision.reason}"

    def status(self, now: float, last_scale_time: str | None) -> AutoscalingStatus:
        return AutoscalingStatus(
            queue_depth=self.sample.waiting if self.sample.measured else None,
            measured_replicas=self.sample.measured,
            desired_replicas=self.decision.desired,
            last_sample_time=to_rfc3339(now),
            last_scale_time=last_scale_time,
        )


def seconds_until_sample(history: History, tick: float, interval: float) -> float | None:
    """None when a sample is due (intervals run on the monotonic clock: `tick`)."""
    if history.last_sample is not None and tick - history.last_sample < interval:
        return history.last_sample + interval - tick
    return None


def plan_scale(
    settings: AutoscalingSpec,
    replicas: int,
    depths: Mapping[int, float | None],
    history: History,
    tick: float,
    router: RouterSample | None = None,
) -> ScalePlan:
    """`depths`: by group index, one per Ready leader (None: no answer). Records the
    recommendation in `history` (its blindness is the caller's to record once it is said)."""
    sample = sample_of(depths, replicas)
    decision = decide(settings, replicas, sample, history, tick, router)
    blind = bool(depths) and sample.measured == 0
    warning = None
    if blind and not history.blind:
        # Said once when it starts: a NetworkPolicy or a port the operator cannot reach would
        # otherwise leave the cluster at its size forever with nothing but a 0 in status.
        warning = (
            f"none of {len(depths)} Ready leaders answered {settings.metric} on /metrics: "
            "not scaling (can the operator reach the leaders' http port?)"
        )
    return ScalePlan(replicas, decision, sample, blind, warning)
