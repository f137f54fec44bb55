"""/metrics under vLLM's names, types, labels and buckets (vllm/v1/metrics/loggers.py), checked
against hand-computed values; and, on a live server, against the usage the responses report."""

import json
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from echo.core.step_results import EngineCoreOutput, SchedulerStats
from echo.engine.output_processor import OutputProcessor
from echo.entrypoints import metrics as metrics_module
from echo.entrypoints.metrics import RequestTimer, ServerMetrics
from echo.outputs import CompletionOutput, RequestOutput
from echo.sampling_params import SamplingParams
from tests.entrypoints.test_api_server import NAME, with_server

# name (as the parser names a family: a counter without its _total) -> Prometheus type
REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}
# what else vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json)
# queries
DASHBOARD = {
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
}
# vLLM's buckets, written out
TTFT_LE = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
           10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_LE = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
          20.0, 40.0, 80.0]
LATENCY_LE = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
              120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def parse(text: bytes | str) -> dict:
    if isinstance(text, bytes):
        text = text.decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, name, sample_name=None, **labels) -> float:
    """The one sample of `name` (sample `sample_name`, default the family's own) whose labels
    include `labels`."""
    sample_name = sample_name or name
    found = [s.value for s in families[name].samples
             if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, sample_name, labels, found)
    return found[0]


def buckets(families, name, **labels) -> dict[float, float]:
    return {float(s.labels["le"]): s.value for s in families[name].samples
            if s.name == name + "_bucket" and labels.items() <= s.labels.items()}


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def output(choices, finished=False, queue_time=None) -> RequestOutput:
    """choices: (index, new token count, tokens so far, finish_reason) per choice."""
    outs = [CompletionOutput(index=i, token_ids=list(range(total)), finish_reason=reason,
                             delta_token_ids=list(range(new)))
            for i, new, total, reason in choices]
    return RequestOutput("r", None, [], outs, finished=finished, queue_time=queue_time)


def test_server_metrics_names_types_labels_and_values(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(perf_counter=clock))
    m = ServerMetrics("m", max_model_len=100, num_engines=2)

    # engine 0, n=1: prompt of 7; tokens at +0.5 (1), +0.6 (2), +0.9 (1, length)
    a = RequestTimer(m, 7)
    clock.now = 100.5
    a.on_output(output([(0, 1, 1, None)], queue_time=0.2))
    clock.now = 100.6
    a.on_output(output([(0, 2, 3, None)], queue_time=0.2))
    clock.now = 100.9
    a.on_output(output([(0, 1, 4, "length")], finished=True, queue_time=0.2))

    # engine 0, n=2: prompt of 5; at +0.25 both choices get a token and choice 1 stops; at
    # +0.45 choice 0 gets 2 and stops while the finished choice 1 rides along
    b = RequestTimer(m, 5, n=2)
    clock.now = 101.15
    b.on_output(output([(0, 1, 1, None), (1, 1, 1, "stop")], queue_time=0.05))
    clock.now = 101.35
    b.on_output(output([(0, 2, 3, "stop"), (1, 0, 1, "stop")], finished=True, queue_time=0.05))

    # engine 1: prompt of 3, one token, then the client leaves
    c = RequestTimer(m, 3, engine=1)
    clock.now = 101.5
    c.on_output(output([(0, 1, 1, None)], queue_time=0.1))
    c.end("abort")
    c.end("error")  # a no-op: it has ended

    # engine 0: the engine fails before the first token
    d = RequestTimer(m, 9)
    d.end("error")
    d.end("abort")

    stats = [SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                            prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1),
             SchedulerStats(num_running=1, kv_cache_usage=0.5, prefix_cache_queries=10,
                            prefix_cache_hits=0, num_preemptions=0)]
    f = parse(m.render(stats))

    for name, kind in {**REQUIRED, **DASHBOARD}.items():
        assert f[name].type == kind, name
        engines = set()
        for s in f[name].samples:
            assert s.labels["model_name"] == "m", s
            engines.add(s.labels["engine"])
        assert engines == {"0", "1"}, name  # every engine's series, even before it served
    # counters are exposed as <name>_total
    assert {s.name for s in f["vllm:prompt_tokens"].samples} == {"vllm:prompt_tokens_total"}
    assert {s.name for s in f["vllm:num_preemptions"].samples} == {"vllm:num_preemptions_total"}

    # engine state
    e0, e1 = {"engine": "0"}, {"engine": "1"}
    assert value(f, "vllm:num_requests_running", **e0) == 3
    assert value(f, "vllm:num_requests_waiting", **e0) == 2
    assert value(f, "vllm:kv_cache_usage_perc", **e0) == 0.25
    assert value(f, "vllm:kv_cache_usage_perc", **e1) == 0.5
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", **e0) == 100
    assert value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", **e0) == 40
    assert value(f, "vllm:num_preemptions", "vllm:num_preemptions_total", **e0) == 1

    # tokens: prompts counted once their first token came (a, b; c on engine 1; not d)
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **e0) == 7 + 5
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total", **e1) == 3
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", **e0) == 4 + 4
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total", **e1) == 1

    # finish reasons: every label value is there, at zero where nothing finished so
    success = {(s.labels["engine"], s.labels["finished_reason"]): s.value
               for s in f["vllm:request_success"].samples}
    assert success == {("0", "stop"): 2, ("0", "length"): 1, ("0", "abort"): 0,
                       ("0", "error"): 1, ("1", "stop"): 0, ("1", "length"): 0,
                       ("1", "abort"): 1, ("1", "error"): 0}

    def hist(name, **labels):
        return (value(f, name, name + "_count", **labels),
                value(f, name, name + "_sum", **labels))

    # TTFT: a 0.5, b 0.25 (it started at 100.9), c 0.15 (it started at 101.35)
    assert hist("vllm:time_to_first_token_seconds", **e0) == (2, pytest.approx(0.75))
    assert hist("vllm:time_to_first_token_seconds", **e1) == (1, pytest.approx(0.15))
    ttft = buckets(f, "vllm:time_to_first_token_seconds", **e0)
    assert list(ttft) == TTFT_LE + [float("inf")]
    assert ttft[0.1] == 0 and ttft[0.25] == 1 and ttft[0.5] == 2
    # ITL: a 0.1 and 0.3, b 0.2
    assert hist("vllm:inter_token_latency_seconds", **e0) == (3, pytest.approx(0.6))
    assert list(buckets(f, "vllm:inter_token_latency_seconds", **e0)) == ITL_LE + [float("inf")]
    assert buckets(f, "vllm:inter_token_latency_seconds", **e0)[0.15] == 1
    # finished by the engine: a and b only (c left, d failed)
    assert hist("vllm:e2e_request_latency_seconds", **e0) == (2, pytest.approx(0.9 + 0.45))
    assert hist("vllm:e2e_request_latency_seconds", **e1) == (0, 0)
    assert (list(buckets(f, "vllm:e2e_request_latency_seconds", **e0))
            == LATENCY_LE + [float("inf")])
    assert hist("vllm:request_queue_time_seconds", **e0) == (2, pytest.approx(0.25))
    # prefill = TTFT - queue: a 0.3, b 0.2; decode: a 0.4, b 0.2
    assert hist("vllm:request_prefill_time_seconds", **e0) == (2, pytest.approx(0.5))
    assert hist("vllm:request_decode_time_seconds", **e0) == (2, pytest.approx(0.6))
    assert hist("vllm:request_inference_time_seconds", **e0) == (2, pytest.approx(1.1))
    # per-request TPOT over the longest choice: a 0.4 / 3, b 0.2 / 2
    assert hist("vllm:request_time_per_output_token_seconds", **e0) == (
        2, pytest.approx(0.4 / 3 + 0.1))
    # lengths: prompts 7 and 5; generated 4 and 3 + 1; longest choice 4 and 3
    assert hist("vllm:request_prompt_tokens", **e0) == (2, 12)
    assert hist("vllm:request_generation_tokens", **e0) == (2, 8)
    assert hist("vllm:request_max_num_generation_tokens", **e0) == (2, 7)
    prompt_le = buckets(f, "vllm:request_prompt_tokens", **e0)
    assert prompt_le == {1: 0, 2: 0, 5: 1, 10: 2, 20: 2, 50: 2, 100: 2, float("inf"): 2}

    # the core's cumulative totals drive the counters at the next scrape
    stats[0] = SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=90, num_preemptions=4)
    f = parse(m.render(stats))
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", **e0) == 150
    assert value(f, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", **e0) == 90
    assert value(f, "vllm:num_preemptions", "vllm:num_preemptions_total", **e0) == 4
    assert value(f, "vllm:num_requests_running", **e0) == 0


def test_speculative_decoding_counters_under_vllms_names():
    m = ServerMetrics("m")
    stats = [SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=12,
                            spec_num_accepted_tokens=7, spec_accepted_per_position=[3, 2, 2, 0])]
    f = parse(m.render(stats))
    for name, total in (("vllm:spec_decode_num_drafts", 3),
                        ("vllm:spec_decode_num_draft_tokens", 12),
                        ("vllm:spec_decode_num_accepted_tokens", 7)):
        assert f[name].type == "counter"
        assert value(f, name, name + "_total", engine="0") == total
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_position = {s.labels["position"]: s.value for s in f[name].samples
                    if s.name == name + "_total"}
    assert per_position == {"0": 3, "1": 2, "2": 2, "3": 0}


def test_queue_time_reaches_the_request_output():
    proc = OutputProcessor(None)
    proc.add_request("r", None, [1, 2, 3], SamplingParams(n=2, max_tokens=4), 0.0)
    results, _ = proc.process_outputs([EngineCoreOutput("r#1", [5], queue_time=0.75)])
    assert results[0].queue_time == 0.75
    # a later sample's own queue time does not replace the first one reported
    results, _ = proc.process_outputs([EngineCoreOutput("r#0", [6], queue_time=2.0),
                                       EngineCoreOutput("r#1", [7])])
    assert results[0].queue_time == 0.75


def test_live_server_exposes_every_name_and_counts_the_usage_it_reports(tiny_chat_model):
    async def test(http, client):
        responses = [
            await http.post("/v1/completions", json={
                "model": NAME, "prompt": ["The capital of France is", "One two three"],
                "max_tokens": 5, "temperature": 0, "ignore_eos": True}),
            await http.post("/v1/completions", json={
                "model": NAME, "prompt": "Hello", "max_tokens": 3, "n": 2, "seed": 1,
                "ignore_eos": True}),
            await http.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 4, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}),
        ]
        return responses, await http.get("/metrics")

    responses, scrape = with_server(tiny_chat_model, test)
    usages = []
    for r in responses:
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("text/event-stream"):
            last = [e for e in r.text.split("\n\n") if '"usage"' in e][-1]
            usages.append(json.loads(last.removeprefix("data: "))["usage"])
        else:
            usages.append(r.json()["usage"])
    assert scrape.status_code == 200
    assert scrape.headers["content-type"].startswith("text/plain")
    f = parse(scrape.text)
    for name, kind in {**REQUIRED, **DASHBOARD}.items():
        assert name in f, name
        assert f[name].type == kind, name
        assert all(s.labels["model_name"] == NAME and s.labels["engine"] == "0"
                   for s in f[name].samples), name

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 2 * 5 + 2 * 3 + 4
    assert value(f, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == prompt
    assert value(f, "vllm:generation_tokens", "vllm:generation_tokens_total") == generated
    # every choice finished for length; one latency observation per prompt
    assert value(f, "vllm:request_success", "vllm:request_success_total",
                 finished_reason="length") == 2 + 2 + 1
    assert value(f, "vllm:request_success", "vllm:request_success_total",
                 finished_reason="stop") == 0
    num_prompts = 2 + 1 + 1
    for name in ["vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prompt_tokens"]:
        assert value(f, name, name + "_count") == num_prompts, name
    assert value(f, "vllm:request_prompt_tokens", "vllm:request_prompt_tokens_sum") == prompt
    assert value(f, "vllm:request_generation_tokens",
                 "vllm:request_generation_tokens_sum") == generated
    # a gap per output after a prompt's first: 4 per prompt of the first request, 3 for the
    # chat; n=2's 6 tokens come in 3 to 6 outputs (both samples' tokens share a step's output
    # when they run in the same steps)
    gaps = value(f, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert 2 * 4 + 3 + 2 <= gaps <= 2 * 4 + 3 + 5
    assert 0 <= value(f, "vllm:request_queue_time_seconds",
                      "vllm:request_queue_time_seconds_sum")
    assert 0 <= value(f, "vllm:kv_cache_usage_perc") <= 1
    assert value(f, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") > 0
