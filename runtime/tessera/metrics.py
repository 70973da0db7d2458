"""Prometheus metrics of the server, named like vLLM's with a `tessera:` prefix.

Dashboards and autoscalers written for vLLM (e.g. on `vllm:num_requests_waiting`, KEDA
triggers, llm-d's endpoint picker) read them under vLLM's own names with `tessera serve
--metrics-prefix vllm` (or `both`: each series under both names). Gauges come from the engine
core's SchedulerStats; counters and latency histograms from the frontend's view of each
engine request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tessera.wire.messages import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, SchedulerStats

PREFIX = "tessera:"
# --metrics-prefix: the name prefixes each series is exported under.
METRIC_PREFIXES: dict[str, tuple[str, ...]] = {
    "tessera": (PREFIX,),
    "vllm": ("vllm:",),
    "both": (PREFIX, "vllm:"),
}

# vLLM's bucket boundaries, so histograms compare one to one.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
_TTFT_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_ITL_BUCKETS += [20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_REQUEST_BUCKETS += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _Series:
    """Every series of one model under one name prefix."""

    def __init__(self, prefix: str, model_name: str, registry: CollectorRegistry) -> None:
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(prefix + name, doc, labels, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, [*labels, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=registry)

        m = model_name
        self.running = gauge("num_requests_running", "Requests in the model execution batch.").labels(m)
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.").labels(m)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.").labels(m)
        self.prompt_tokens = counter("prompt_tokens_total", "Prefill tokens processed.").labels(m)
        self.generation_tokens = counter("generation_tokens_total", "Generation tokens processed.").labels(m)
        self.success = counter("request_success_total", "Finished requests.", ("finished_reason",))
        self.preemptions = counter("num_preemptions_total", "Preemptions by the scheduler.").labels(m)
        self.prefix_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        ).labels(m)
        self.prefix_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache."
        ).labels(m)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(m)
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS).labels(m)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS
        ).labels(m)
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting before the first step.", _REQUEST_BUCKETS
        ).labels(m)
        # Every series exists from start-up at 0, as vLLM's (labelled above): a scraper (or the
        # operator's autoscaler) reads an idle server's queue as 0, not as "no data".
        for reason in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR):
            self.success.labels(m, reason)


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        prefixes: tuple[str, ...] = (PREFIX,),
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._series = [_Series(prefix, model_name, self.registry) for prefix in prefixes]

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        for s in self._series:
            s.running.set(stats.num_running_reqs)
            s.waiting.set(stats.num_waiting_reqs)
            s.kv_usage.set(stats.kv_cache_usage)
            s.preemptions.inc(stats.num_preemptions)
            s.prefix_queries.inc(stats.prefix_cache_queries)
            s.prefix_hits.inc(stats.prefix_cache_hits)

    def record_first_token(self, prompt_tokens: int, ttft_s: float, queue_time_s: float) -> None:
        for s in self._series:
            s.prompt_tokens.inc(prompt_tokens)
            s.ttft.observe(ttft_s)
            s.queue.observe(max(queue_time_s, 0.0))

    def record_generation_tokens(self, count: int) -> None:
        for s in self._series:
            s.generation_tokens.inc(count)

    def record_inter_token_latency(self, seconds: float) -> None:
        for s in self._series:
            s.itl.observe(seconds)

    def record_finished(self, finished_reason: str, e2e_s: float) -> None:
        for s in self._series:
            s.success.labels(self.model_name, finished_reason).inc()
            s.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
