"""Prometheus metrics of the server, named like vLLM's with a `tessera:` prefix.

Dashboards and autoscalers written for vLLM (e.g. on `vllm:num_requests_waiting`) work
after swapping the prefix. Gauges come from the engine core's SchedulerStats; counters
and latency histograms from the frontend's view of each engine request.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tessera.wire.messages import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, SchedulerStats

PREFIX = "tessera:"

# vLLM's bucket boundaries, so histograms compare one to one.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
_TTFT_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
_ITL_BUCKETS += [20.0, 40.0, 80.0]
_REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
_REQUEST_BUCKETS += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self._running = gauge("num_requests_running", "Requests in the model execution batch.")
        self._waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv_usage = gauge("kv_cache_usage_perc", "KV cache usage: 1 means 100 percent.")
        self._prompt_tokens = counter("prompt_tokens_total", "Prefill tokens processed.")
        self._generation_tokens = counter("generation_tokens_total", "Generation tokens processed.")
        self._success = counter("request_success_total", "Finished requests.", ("finished_reason",))
        self._preemptions = counter("num_preemptions_total", "Preemptions by the scheduler.")
        self._prefix_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."
        )
        self._prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _REQUEST_BUCKETS)
        self._queue = histogram(
            "request_queue_time_seconds", "Time waiting before the first step.", _REQUEST_BUCKETS
        )
        self.model_name = model_name
        # Every series exists from start-up at 0, as vLLM's: a scraper (or the operator's
        # autoscaler) reads an idle server's queue as 0, not as "no data".
        for metric in (self._running, self._waiting, self._kv_usage, self._prompt_tokens,
                       self._generation_tokens, self._preemptions, self._prefix_queries,
                       self._prefix_hits, self._ttft, self._itl, self._e2e, self._queue):  # fmt: skip
            metric.labels(model_name)
        for reason in (FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR):
            self._success.labels(model_name, reason)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self._running.labels(m).set(stats.num_running_reqs)
        self._waiting.labels(m).set(stats.num_waiting_reqs)
        self._kv_usage.labels(m).set(stats.kv_cache_usage)
        self._preemptions.labels(m).inc(stats.num_preemptions)
        self._prefix_queries.labels(m).inc(stats.prefix_cache_queries)
        self._prefix_hits.labels(m).inc(stats.prefix_cache_hits)

    def record_first_token(self, prompt_tokens: int, ttft_s: float, queue_time_s: float) -> None:
        self._prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self._ttft.labels(self.model_name).observe(ttft_s)
        self._queue.labels(self.model_name).observe(max(queue_time_s, 0.0))

    def record_generation_tokens(self, count: int) -> None:
        self._generation_tokens.labels(self.model_name).inc(count)

    def record_inter_token_latency(self, seconds: float) -> None:
        self._itl.labels(self.model_name).observe(seconds)

    def record_finished(self, finished_reason: str, e2e_s: float) -> None:
        self._success.labels(self.model_name, finished_reason).inc()
        self._e2e.labels(self.model_name).observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
