"""The Prometheus page before any request: every series is there at 0 (scrapers and the operator's
queue-depth autoscaler read an idle server's queue as 0, not as missing)."""

from __future__ import annotations

from tessera.metrics import EngineMetrics
from tessera_operator.scaling.autoscaler import parse_gauge


def test_a_fresh_server_exports_its_gauges_and_counters_at_zero() -> None:
    page = EngineMetrics("m").render().decode()
    assert parse_gauge(page, "tessera:num_requests_waiting") == 0.0
    assert parse_gauge(page, "tessera:num_requests_running") == 0.0
    assert parse_gauge(page, "tessera:generation_tokens_total") == 0.0
    for reason in ("stop", "length", "abort", "error"):
        assert f'tessera:request_success_total{{finished_reason="{reason}",model_name="m"}} 0.0' in page
    assert 'tessera:time_to_first_token_seconds_count{model_name="m"} 0.0' in page


def test_metrics_prefix_both_exports_every_series_under_both_names() -> None:
    from tessera.metrics import METRIC_PREFIXES
    from tessera.wire.messages import SchedulerStats

    metrics = EngineMetrics("m", prefixes=METRIC_PREFIXES["both"])
    metrics.record_scheduler_stats(SchedulerStats(num_waiting_reqs=3))
    page = metrics.render().decode()
    assert parse_gauge(page, "tessera:num_requests_waiting") == 3.0
    assert parse_gauge(page, "vllm:num_requests_waiting") == 3.0
    vllm_only = EngineMetrics("m", prefixes=METRIC_PREFIXES["vllm"]).render().decode()
    assert "vllm:kv_cache_usage_perc" in vllm_only and "tessera:" not in vllm_only
