"""Prometheus metrics of one server: latency histograms observed per request in the frontend,
engine gauges refreshed from the core's latest SchedulerStats at scrape time."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from echo.core.step_results import SchedulerStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labelnames=["model_name"], buckets=buckets,
                             registry=r).labels(**labels)

        def gauge(name, doc):
            return Gauge(name, doc, labelnames=["model_name"], registry=r).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, labelnames=["model_name"], registry=r).labels(**labels)

        self.ttft = histogram("echo_time_to_first_token_seconds", "Time to first token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("echo_inter_token_latency_seconds", "Time between output chunks",
                             _ITL_BUCKETS)
        self.e2e = histogram("echo_e2e_request_latency_seconds", "End-to-end request latency",
                             _LATENCY_BUCKETS)
        self.queue_time = histogram("echo_request_queue_time_seconds",
                                    "Arrival to first scheduling in the core", _LATENCY_BUCKETS)
        self.prompt_tokens = counter("echo_prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("echo_generation_tokens", "Tokens generated")
        self.requests = counter("echo_requests", "Finished requests")
        self.running = gauge("echo_num_requests_running", "Requests running in the core")
        self.waiting = gauge("echo_num_requests_waiting", "Requests waiting in the core")
        self.kv_usage = gauge("echo_kv_cache_usage_perc", "Fraction of KV blocks in use")
        self.prefix_hit_rate = gauge("echo_prefix_cache_hit_rate",
                                     "Prefix-cache hits / queries, in tokens, since start")
        self.preemptions = gauge("echo_num_preemptions", "Preemptions since start")

    def update_engine(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        queries = stats.prefix_cache_queries
        self.prefix_hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
        self.preemptions.set(stats.num_preemptions)

    def render(self, stats: SchedulerStats) -> bytes:
        self.update_engine(stats)
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, inter-token latencies and end-to-end latency."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        metrics.prompt_tokens.inc(num_prompt_tokens)

    def on_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.perf_counter()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        self.first = False
        self.last = now
        self.metrics.generation_tokens.inc(num_new_tokens)

    def on_finish(self) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.start)
        self.metrics.requests.inc()
