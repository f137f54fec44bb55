"""Prometheus metrics of one server, under vLLM's names, types, labels and buckets
(vllm/v1/metrics/loggers.py), so vLLM's Grafana dashboard and other vLLM tooling work unchanged.

Every series carries model_name (the first served name) and engine (the core's index, "0" while
there is one core; with data parallelism each core's stats get their own index).

- Engine state comes from each core's latest SchedulerStats, read at scrape time by a collector:
  vllm:num_requests_running / num_requests_waiting / kv_cache_usage_perc are gauges, and
  vllm:prefix_cache_queries / prefix_cache_hits / num_preemptions are counters whose value is the
  core's cumulative total, and so are speculative decoding's vllm:spec_decode_num_drafts /
  num_draft_tokens / num_accepted_tokens / num_accepted_tokens_per_pos{position}, and the KV
  host tier's echo:kv_host_tier_queries / kv_host_tier_hits (tokens) and
  echo:kv_offload_stored_blocks / loaded_blocks / stored_bytes / loaded_bytes /
  transfer_seconds, and structured outputs' echo:structured_output_accept_seconds /
  fill_seconds, the host time on grammars: the core's, or with grammar processes the slowest
  process's in each step (vLLM has no names for these).
- Requests are observed in the frontend by a RequestTimer, one per prompt (one stream of
  RequestOutputs): vllm:prompt_tokens and vllm:generation_tokens count tokens (so they add up to
  the usage the responses report); vllm:request_success{finished_reason} counts each finished
  choice (stop, length, abort, error; a client that leaves early aborts the unfinished ones);
  the histograms observe one value per prompt once the engine finished it: TTFT and the gaps
  between outputs while it runs, then end-to-end latency, queue, prefill, decode and inference
  time, per-request time per output token, prompt and generation lengths. With n > 1 the
  generation length is the choices' total and the max-generation and per-token figures use the
  longest choice.
"""

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from echo.core.step_results import SchedulerStats
from echo.outputs import RequestOutput

LABELS = ["model_name", "engine"]
FINISH_REASONS = ("stop", "length", "abort", "error")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# token-count buckets stop at max_model_len; without one, at a bound no model reaches
DEFAULT_MAX_MODEL_LEN = 1 << 20


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


# the series read from each core's SchedulerStats: (family, name, help, the stats field);
# vLLM's names first, then echo's own for the KV cache's host tier (kv_offloading_size)
_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
ENGINE_SERIES = (
    (_GAUGE, "vllm:num_requests_running", "Number of requests in model execution batches.",
     "num_running"),
    (_GAUGE, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
     "num_waiting"),
    (_GAUGE, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     "kv_cache_usage"),
    (_COUNTER, "vllm:prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    (_COUNTER, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    (_COUNTER, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
     "num_preemptions"),
    (_COUNTER, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
     "spec_num_drafts"),
    (_COUNTER, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
     "spec_num_draft_tokens"),
    (_COUNTER, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
     "spec_num_accepted_tokens"),
    (_COUNTER, "echo:kv_host_tier_queries", "Tokens looked up in the KV cache's host tier.",
     "kv_host_queries"),
    (_COUNTER, "echo:kv_host_tier_hits", "Tokens found in the host tier (and loaded).",
     "kv_host_hits"),
    (_COUNTER, "echo:kv_offload_stored_blocks", "KV blocks copied to the host tier.",
     "kv_stored_blocks"),
    (_COUNTER, "echo:kv_offload_loaded_blocks", "KV blocks loaded from the host tier.",
     "kv_loaded_blocks"),
    (_COUNTER, "echo:kv_offload_loads", "Requests whose prefix was loaded from the host tier.",
     "kv_loads"),
    (_COUNTER, "echo:kv_offload_load_wait_seconds",
     "Time requests waited for their host-tier loads, from the step that started each to the "
     "output that reported it done.", "kv_load_wait_seconds"),
    (_COUNTER, "echo:kv_offload_loads_joined",
     "Loads whose request ran in the step that carried them (early loads), not counted in "
     "the wait.", "kv_loads_joined"),
    (_COUNTER, "echo:kv_offload_stored_bytes", "Bytes copied to the host tier (all ranks).",
     "kv_stored_bytes"),
    (_COUNTER, "echo:kv_offload_loaded_bytes", "Bytes loaded from the host tier (all ranks).",
     "kv_loaded_bytes"),
    (_COUNTER, "echo:kv_offload_transfer_seconds",
     "Time the host tier's copies took on rank 0's device.", "kv_transfer_seconds"),
    (_COUNTER, "echo:structured_output_accept_seconds",
     "Time advancing grammars past sampled tokens (the core's, or the slowest grammar "
     "process's each step).", "grammar_accept_seconds"),
    (_COUNTER, "echo:structured_output_fill_seconds",
     "Time filling token bitmasks (the core's, or the slowest grammar process's each "
     "step).", "grammar_fill_seconds"),
)


class _EngineCollector:
    """Yields the engine gauges and cumulative counters from each core's latest stats."""

    def __init__(self, metrics: "ServerMetrics"):
        self.metrics = metrics

    def collect(self):
        model = self.metrics.model_name
        for kind, name, documentation, field in ENGINE_SERIES:
            family = kind(name, documentation, labels=LABELS)
            for engine, stats in enumerate(self.metrics.engine_stats):
                family.add_metric([model, str(engine)], getattr(stats, field))
            yield family
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.",
                                           labels=[*LABELS, "position"])
        for engine, stats in enumerate(self.metrics.engine_stats):
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_position.add_metric([model, str(engine), str(position)], count)
        yield per_position


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int | None = None, num_engines: int = 1):
        self.model_name = model_name
        self.engine_stats: list[SchedulerStats] = [SchedulerStats() for _ in range(num_engines)]
        self.registry = r = CollectorRegistry()
        token_buckets = build_1_2_5_buckets(max_model_len or DEFAULT_MAX_MODEL_LEN)
        engines = [str(i) for i in range(num_engines)]

        def per_engine(metric) -> list:
            # children made up front, so every series is exposed (at zero) before any request
            return [metric.labels(model_name, e) for e in engines]

        def histogram(name: str, doc: str, buckets) -> list:
            return per_engine(Histogram(name, doc, LABELS, buckets=buckets, registry=r))

        def counter(name: str, doc: str) -> list:
            return per_engine(Counter(name, doc, LABELS, registry=r))

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.success = Counter("vllm:request_success",
                               "Count of successfully processed requests.",
                               LABELS + ["finished_reason"], registry=r)
        self.request_success = [{reason: self.success.labels(model_name, e, reason)
                                 for reason in FINISH_REASONS} for e in engines]
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.",
                                      ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        r.register(_EngineCollector(self))

    def update_engines(self, stats: Sequence[SchedulerStats]) -> None:
        """Each core's latest stats, by engine index."""
        for engine, s in enumerate(stats):
            self.engine_stats[engine] = s

    def render(self, stats: Sequence[SchedulerStats] = ()) -> bytes:
        self.update_engines(stats)
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one prompt's stream of RequestOutputs (all its n choices).

    Times are the frontend's, from this timer's creation (the request's arrival); the queue time
    is the core's (arrival to first scheduling, RequestOutput.queue_time); prefill is the rest of
    the time to the first token, decode the time from the first token to the last."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, n: int = 1,
                 engine: int = 0):
        self.m, self.engine = metrics, engine
        self.num_prompt_tokens = num_prompt_tokens
        self.start = time.perf_counter()
        self.first_token: float | None = None
        self.last_token = self.start
        self.queue_time: float | None = None
        self.finished_choices: set[int] = set()
        self.num_choices = n
        self.done = False

    def on_output(self, out: RequestOutput) -> None:
        if self.done:
            return
        now = time.perf_counter()
        m, e = self.m, self.engine
        if self.queue_time is None and out.queue_time is not None:
            self.queue_time = max(0.0, out.queue_time)
        num_new = 0
        for choice in out.outputs:
            num_new += len(choice.delta_token_ids)
            if choice.finish_reason is not None and choice.index not in self.finished_choices:
                self.finished_choices.add(choice.index)
                self._count_finished(choice.finish_reason)
        if num_new:
            if self.first_token is None:  # the prefill is done
                self.first_token = now
                m.prompt_tokens[e].inc(self.num_prompt_tokens)
                m.ttft[e].observe(now - self.start)
            else:
                m.itl[e].observe(now - self.last_token)
            self.last_token = now
            m.generation_tokens[e].inc(num_new)
        if out.finished:
            self._finish(out, now)

    def end(self, reason: str) -> None:
        """The stream stopped before the engine finished it: its unfinished choices end with
        `reason` (abort: the client left; error: the engine failed). A no-op once finished."""
        if self.done:
            return
        self.done = True
        for index in range(self.num_choices):
            if index not in self.finished_choices:
                self.finished_choices.add(index)
                self._count_finished(reason)

    def _count_finished(self, reason: str) -> None:
        counters = self.m.request_success[self.engine]
        if reason not in counters:  # not one the core sends today; still counted, by name
            counters[reason] = self.m.success.labels(self.m.model_name, str(self.engine), reason)
        counters[reason].inc()

    def _finish(self, out: RequestOutput, now: float) -> None:
        self.done = True
        m, e = self.m, self.engine
        m.e2e[e].observe(now - self.start)
        lengths = [len(c.token_ids) for c in out.outputs] or [0]
        m.request_prompt_tokens[e].observe(self.num_prompt_tokens)
        m.request_generation_tokens[e].observe(sum(lengths))
        m.request_max_generation_tokens[e].observe(max(lengths))
        if self.first_token is None:
            return  # finished without a token (aborted in the core): no phases to time
        queue = self.queue_time
        if queue is not None:
            m.queue_time[e].observe(queue)
        prefill = max(0.0, self.first_token - self.start - (queue or 0.0))
        decode = self.last_token - self.first_token
        m.prefill_time[e].observe(prefill)
        m.decode_time[e].observe(decode)
        m.inference_time[e].observe(prefill + decode)
        longest = max(lengths)
        m.request_tpot[e].observe(decode / (longest - 1) if longest > 1 else 0.0)
