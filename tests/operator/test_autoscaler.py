"""The queue-depth autoscaler: its pure rules, the /metrics reader on real sockets, and the
reconciler setting replicas through the scale subresource (the genuine API server and runtime are
in tests/integration/test_operator_autoscaling.py and tests/e2e)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from tessera.router.metrics import RouterMetrics
from tessera_operator.admission.validation import validate_policies
from tessera_operator.api import AutoscalingSpec, InferenceClusterSpec
from tessera_operator.reconcile.reconciler import Reconciler
from tessera_operator.scaling.autoscaler import (
    History,
    QueueSample,
    RouterSample,
    decide,
    parse_gauge,
    recommend,
    sample_of,
    seed,
)
from tessera_operator.scaling.queue_metrics import MAX_BODY_BYTES, metrics_url, queue_depths, router_sample
from tests.fixtures.loopback_http import serving
from tests.operator.test_reconcile_unit import IC_PATH, fake_with_cluster

METRIC = "tessera:num_requests_waiting"
EXPOSITION = """# HELP tessera:num_requests_waiting Requests waiting to be scheduled.
# TYPE tessera:num_requests_waiting gauge
tessera:num_requests_waiting{model_name="smollm2"} 5.0
tessera:num_requests_waiting_total 99
tessera:num_requests_running{model_name="smollm2"} 2.0
"""


def spec(**fields: Any) -> AutoscalingSpec:
    return AutoscalingSpec.model_validate({"enabled": True, "minReplicas": 1, "maxReplicas": 8, **fields})


def test_the_gauge_is_read_by_exact_name_and_summed_over_its_samples() -> None:
    assert parse_gauge(EXPOSITION, METRIC) == 5.0
    two = EXPOSITION + 'tessera:num_requests_waiting{model_name="other"} 3\n'
    assert parse_gauge(two, METRIC) == 8.0
    assert parse_gauge(f"{METRIC} 4 1700000000000\n", METRIC) == 4.0  # no labels, a timestamp
    assert parse_gauge("tessera:num_requests_running 1\n", METRIC) is None
    assert parse_gauge("tessera:num_requests_waiting NaNx\n", METRIC) is None


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-3"])
def test_a_gauge_no_queue_can_have_leaves_the_group_unmeasured(value: str) -> None:
    """NaN or infinity would raise in the recommendation (every pass of the cluster with it);
    a negative depth would scale a loaded cluster down."""
    assert parse_gauge(EXPOSITION + f'{METRIC}{{model_name="x"}} {value}\n', METRIC) is None


def test_scale_up_asks_for_enough_groups_for_the_target_and_is_immediate() -> None:
    history = History()
    seed(history, 0.0, 1)
    decision = decide(
        spec(targetQueueDepth=8), 1, QueueSample(waiting=20, measured=1, unmeasured=0), history, 1.0
    )
    assert (decision.desired, decision.recommendation) == (3, 3)
    assert "20 requests waiting at 1 Ready group(s)" in decision.reason


def test_a_cluster_parked_at_zero_stays_there() -> None:
    # `kubectl scale --replicas=0`: no leader to measure, and minReplicas must not undo it (the HPA's rule).
    decision = decide(
        spec(minReplicas=1), 0, QueueSample(waiting=0, measured=0, unmeasured=0), History(), 1.0
    )
    assert decision.desired == 0 and "scaled to zero" in decision.reason


def test_scale_up_at_most_doubles_or_adds_four_and_stops_at_max_replicas() -> None:
    sample = QueueSample(waiting=400, measured=1, unmeasured=0)
    assert decide(spec(targetQueueDepth=1, maxReplicas=256), 1, sample, History(), 0.0).desired == 5
    assert decide(spec(targetQueueDepth=1, maxReplicas=256), 10, sample, History(), 0.0).desired == 20
    assert decide(spec(targetQueueDepth=1, maxReplicas=3), 1, sample, History(), 0.0).desired == 3


def test_within_the_tolerance_nothing_changes() -> None:
    assert recommend(spec(targetQueueDepth=8), 2, QueueSample(waiting=17, measured=2, unmeasured=0))[0] == 2
    assert recommend(spec(targetQueueDepth=8), 2, QueueSample(waiting=19, measured=2, unmeasured=0))[0] == 3


def test_groups_still_loading_count_as_empty_on_a_scale_up_as_the_hpa_counts_missing_pods() -> None:
    """33 waiting at the one Ready group of 4 is 8.25 a group: within 10% of 8, no change (the HPA's
    calcPlainMetricReplicas); asking for a fifth would hold it for the whole stabilization window."""
    settings = spec(targetQueueDepth=8)
    assert recommend(settings, 4, sample_of({0: 33.0}, 4))[0] == 4
    assert recommend(settings, 2, sample_of({0: 17.0}, 2))[0] == 2
    assert recommend(settings, 2, sample_of({0: 40.0}, 2))[0] == 5  # a real excess still scales


def test_scale_down_waits_for_the_stabilization_window() -> None:
    settings = spec(targetQueueDepth=4, scaleDownStabilizationSeconds=60)
    idle = QueueSample(waiting=0, measured=3, unmeasured=0)
    history = History()
    seed(history, 0.0, 3)
    assert decide(settings, 3, idle, history, 10.0).desired == 3  # the seed is still in the window
    assert decide(settings, 3, QueueSample(waiting=8, measured=3, unmeasured=0), history, 30.0).desired == 3
    assert decide(settings, 3, idle, history, 65.0).desired == 2  # (30 s, 2) is the window's highest
    assert decide(settings, 2, idle, history, 95.0).desired == 1


def test_no_scale_down_while_a_group_is_not_measured() -> None:
    """Scale-down removes the highest groups: with group 0 down and groups 1-2 idle, scaling to
    one group would keep the one that serves nothing."""
    settings = spec(targetQueueDepth=4, scaleDownStabilizationSeconds=0)
    held = decide(settings, 3, sample_of({1: 0.0, 2: None}, 3), History(), 0.0)
    assert held.desired == 3 and "not measured: no scale-down" in held.reason
    assert decide(settings, 3, sample_of({0: 0.0, 1: 0.0, 2: 0.0}, 3), History(), 0.0).desired == 1
    # A rollout's surge group 3 answers, but does not stand in for group 0, which is down.
    surge = sample_of({1: 0.0, 2: 0.0, 3: 0.0}, 3)
    assert surge.unmeasured == 1 and decide(settings, 3, surge, History(), 0.0).desired == 3
    # ... but never hold back a scale-up: the queue that was measured is real.
    assert decide(settings, 3, sample_of({0: 40.0, 1: None}, 3), History(), 0.0).desired == 7


def test_without_any_measurement_only_the_bounds_apply() -> None:
    nothing = sample_of({}, 4)
    assert decide(spec(maxReplicas=8), 4, nothing, History(), 0.0).desired == 4
    assert decide(spec(maxReplicas=2), 4, nothing, History(), 0.0).desired == 2  # above max: down now
    assert decide(spec(minReplicas=3), 1, nothing, History(), 0.0).desired == 3


def test_min_replicas_zero_needs_the_router_which_counts_the_requests_at_zero() -> None:
    base = {"model": {"source": "m"}, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2}}
    assert validate_policies(InferenceClusterSpec.model_validate(base)) == []
    off = InferenceClusterSpec.model_validate({**base, "router": {"enabled": False}})
    [error] = validate_policies(off)
    assert error.field == "spec.autoscaling.minReplicas" and "spec.router.enabled" in error.message


def router(held: float = 0, inflight: float = 0, requests: float = 0, at_zero: float = 0) -> RouterSample:
    return RouterSample(held, inflight, requests, at_zero)


def test_the_last_group_goes_only_after_the_idle_window_and_comes_back_for_a_request() -> None:
    settings = spec(minReplicas=0, scaleDownStabilizationSeconds=0, scaleToZeroSeconds=100)
    idle = QueueSample(waiting=0, measured=1, unmeasured=0)
    history = History()
    # Busy through the router: requests open, then its counter moving, keep the last group.
    assert decide(settings, 1, idle, history, 0.0, router(inflight=2, requests=5)).desired == 1
    assert decide(settings, 1, idle, history, 50.0, router(requests=9)).desired == 1
    quiet = decide(settings, 1, idle, history, 120.0, router(requests=9))
    assert quiet.desired == 1 and "idle 70 s of 100" in quiet.reason  # the window runs from t=50
    assert decide(settings, 1, idle, history, 149.0, router(requests=9)).desired == 1
    # Blind (no router numbers): never to zero.
    assert decide(settings, 1, idle, History(), 10_000.0, None).desired == 1
    gone = decide(settings, 1, idle, history, 150.0, router(requests=9))
    assert gone.desired == 0 and "scaling to zero" in gone.reason
    # At zero: nothing arrives, nothing changes; a request arriving (counted, or still held) brings one.
    none = QueueSample(waiting=0, measured=0, unmeasured=0)
    assert decide(settings, 0, none, history, 160.0, router(requests=9)).desired == 0
    back = decide(settings, 0, none, history, 170.0, router(requests=9, at_zero=1))
    assert back.desired == 1 and "arrived at the router" in back.reason
    assert decide(settings, 0, none, History(), 0.0, router(held=3)).desired == 1
    assert decide(settings, 0, none, History(), 0.0, None).desired == 0  # no numbers: stays
    # The group that came back is not taken away again before a full idle window.
    assert decide(settings, 1, none, history, 180.0, router(requests=9, at_zero=1)).desired == 1


def test_parked_at_zero_by_hand_stays_without_min_replicas_zero() -> None:
    none = QueueSample(waiting=0, measured=0, unmeasured=0)
    assert decide(spec(minReplicas=1), 0, none, History(), 0.0, router(held=5)).desired == 0


async def test_the_router_series_are_read_by_their_names_from_the_routers_own_page(
    metrics_server: tuple[int, dict[str, Any]],
) -> None:
    port, answer = metrics_server
    page = RouterMetrics()  # the router's own exposition
    page.held.set(2)
    page.at_zero.inc(3)
    page.requests.labels("http://10.0.0.1:8000").inc(7)
    page.inflight.labels("http://10.0.0.1:8000").set(1)
    answer["body"] = page.render().decode()
    pods = [
        leader_pod("127.0.0.1", port),
        leader_pod("127.0.0.1", port),
        leader_pod("127.0.0.1", closed_port()),
    ]
    assert await router_sample(pods) == RouterSample(4, 2, 14, 6, unanswered=1)
    assert await router_sample(pods[2:]) is None


def leader_pod(ip: str | None, port: int) -> dict[str, Any]:
    return {
        "spec": {
            "containers": [
                {"ports": [{"name": "dist", "containerPort": 1}, {"name": "http", "containerPort": port}]}
            ]
        },
        "status": {"podIP": ip} if ip else {},
    }


def test_the_metrics_url_is_the_leaders_http_port() -> None:
    assert metrics_url(leader_pod("10.1.2.3", 8000)) == "http://10.1.2.3:8000/metrics"
    assert metrics_url(leader_pod("fd00::5", 8001)) == "http://[fd00::5]:8001/metrics"
    assert metrics_url(leader_pod(None, 8000)) is None


@pytest.fixture
async def metrics_server() -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """A real HTTP server on 127.0.0.1 whose /metrics answers what the test sets."""
    answer: dict[str, Any] = {"status": 200, "body": EXPOSITION}

    async def metrics(request: web.Request) -> web.StreamResponse:
        if isinstance(answer["body"], str):
            return web.Response(status=answer["status"], text=answer["body"])
        stream = web.StreamResponse()  # a list of pieces: sent apart, as TCP may deliver a page
        await stream.prepare(request)
        for piece in answer["body"]:
            await stream.write(piece.encode())
            await asyncio.sleep(0.1)
        await stream.write_eof()
        return stream

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serving(app) as port:
        yield port, answer


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_leaders_that_do_not_answer_are_unmeasured_not_idle(
    metrics_server: tuple[int, dict[str, Any]],
) -> None:
    port, answer = metrics_server
    leaders = [leader_pod("127.0.0.1", port), leader_pod("127.0.0.1", closed_port()), leader_pod(None, port)]
    assert await queue_depths(leaders, METRIC) == [5.0, None, None]
    answer["status"] = 503
    assert await queue_depths(leaders[:1], METRIC) == [None]


async def test_a_page_is_read_whole_and_an_oversized_one_is_unmeasured(
    metrics_server: tuple[int, dict[str, Any]],
) -> None:
    port, answer = metrics_server
    answer["body"] = [f"{METRIC} 1", "2.0\n"]  # the value split across two writes
    assert await queue_depths([leader_pod("127.0.0.1", port)], METRIC) == [12.0]
    answer["body"] = [f"{METRIC} 3\n", "#" * (MAX_BODY_BYTES + 1)]
    assert await queue_depths([leader_pod("127.0.0.1", port)], METRIC) == [None]


async def test_a_pass_samples_ready_leaders_and_scales_through_the_scale_subresource(
    metrics_server: tuple[int, dict[str, Any]],
) -> None:
    port, answer = metrics_server
    answer["body"] = f"{METRIC} 7\n"
    autoscaling = {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepth": 2}
    client = fake_with_cluster(replicas=1, autoscaling=autoscaling)
    now = [1000.0]
    reconciler = Reconciler(client, clock=lambda: now[0], monotonic=lambda: now[0], autoscale_interval=15)  # type: ignore[arg-type]
    await reconciler.reconcile("ns", "demo")  # creates the pods; no leader is Ready yet
    status = client.objects[IC_PATH]["status"]["autoscaling"]
    assert status["measuredReplicas"] == 0 and status["desiredReplicas"] == 1
    assert not any(path.endswith("/scale") for _, path in client.calls)

    leader = next(o for p, o in client.objects.items() if p.endswith("/pods/demo-g0-s0-t0"))
    leader["spec"]["containers"][0]["ports"] = [{"name": "http", "containerPort": port}]
    leader["status"] = {
        "phase": "Running",
        "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": "True"}],
    }
    now[0] += 5  # not due yet: the last sample is kept, nothing scraped
    assert await reconciler.reconcile("ns", "demo") == pytest.approx(10)
    assert client.objects[IC_PATH]["spec"]["replicas"] == 1

    now[0] += 10
    await reconciler.reconcile("ns", "demo")
    assert client.objects[IC_PATH]["spec"]["replicas"] == 3  # 7 waiting / 2 per group, at most 3
    status = client.objects[IC_PATH]["status"]["autoscaling"]
    assert (status["queueDepth"], status["measuredReplicas"], status["desiredReplicas"]) == (7.0, 1, 3)
    assert status["lastScaleTime"] == status["lastSampleTime"]
    [scaled] = [e for e in client.events if e["reason"] == "ScaledUp"]
    assert scaled["type"] == "Normal" and scaled["message"].startswith("replicas 1 -> 3: 7 requests waiting")
