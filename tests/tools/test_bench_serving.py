"""tools/bench_serving.py: metrics on hand-made records, SSE parsing, and whole runs against a
fake OpenAI-compatible server whose timing the test knows: in process on an event loop with a
virtual clock (every time measured is then exact, however loaded the machine), and over HTTP
(uvicorn in a thread) for the real network path."""

import asyncio
import json
import math
import selectors
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_serving  # noqa: E402
from serving_client import SSEDecoder, chunk_text  # noqa: E402
from serving_metrics import (  # noqa: E402
    RequestRecord,
    distribution,
    format_table,
    meets_slos,
    output_timeline,
    parse_slos,
    summarize,
)

# ---------------------------------------------------------------- metrics on hand-made records


def test_distribution_percentiles_by_hand():
    # ms 100 200 300 400 1000: p90 sits 0.6 of the way from 400 to 1000 (rank 0.9 * 4 = 3.6)
    stats = distribution([0.1, 0.2, 0.3, 0.4, 1.0])
    assert stats == pytest.approx({"mean": 400, "median": 300, "p90": 760, "p99": 976})
    assert distribution([]) == {"mean": None, "median": None, "p90": None, "p99": None}


def test_tpot_and_chunk_times():
    r = RequestRecord(prompt_tokens=10, start=2.0, ttft=0.1, itl=[0.1, 0.2], latency=0.5,
                      output_tokens=5)
    assert r.tpot == pytest.approx(0.1)  # (0.5 - 0.1) / (5 - 1)
    assert r.chunk_times() == pytest.approx([2.1, 2.2, 2.4])
    assert RequestRecord(prompt_tokens=1, ttft=0.1, latency=0.1, output_tokens=1).tpot is None


def hand_records() -> list[RequestRecord]:
    return [
        # ttft 100 ms, tpot (1.0 - 0.1) / 9 = 100 ms, e2e 1000 ms
        RequestRecord(prompt_tokens=100, start=0.05, ttft=0.1, itl=[0.1] * 9, latency=1.0,
                      output_tokens=10),
        # ttft 300 ms, tpot (0.5 - 0.3) / 4 = 50 ms, e2e 500 ms; 2 chunks carry 2 tokens each
        RequestRecord(prompt_tokens=50, start=0.55, ttft=0.3, itl=[0.1, 0.1], latency=0.5,
                      output_tokens=5),
        # a single output token: no TPOT, no ITL
        RequestRecord(prompt_tokens=30, start=1.0, ttft=0.2, latency=0.2, output_tokens=1),
        RequestRecord(prompt_tokens=999, start=1.5, latency=0.05, error="HTTP 500: boom"),
    ]


def test_summary_by_hand():
    s = summarize(hand_records(), duration=2.0, slos={"ttft": 250, "tpot": 80})
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (180, 16)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_throughput"] == pytest.approx(90)
    assert s["output_throughput"] == pytest.approx(8)
    assert s["total_token_throughput"] == pytest.approx(98)
    assert s["ttft_ms"] == pytest.approx({"mean": 200, "median": 200, "p90": 280, "p99": 298})
    assert s["tpot_ms"] == pytest.approx({"mean": 75, "median": 75, "p90": 95, "p99": 99.5})
    assert s["itl_ms"] == pytest.approx({"mean": 100, "median": 100, "p90": 100, "p99": 100})
    assert s["e2el_ms"]["mean"] == pytest.approx((1000 + 500 + 200) / 3)
    assert s["e2el_ms"]["median"] == pytest.approx(500)
    # good: only the 1-token request (ttft 200 <= 250, tpot counts as 0); the first misses
    # tpot (100 > 80), the second misses ttft (300 > 250)
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(0.5)
    assert s["slos_ms"] == {"ttft": 250, "tpot": 80}
    assert "goodput" not in summarize(hand_records(), 2.0)


def test_goodput_slos():
    first = hand_records()[0]
    assert meets_slos(first, {"ttft": 100, "tpot": 100, "e2el": 1000})  # equal is good
    assert not meets_slos(first, {"e2el": 999})
    assert not meets_slos(hand_records()[3], {})  # a failed request is never good
    assert parse_slos(["ttft:500", "tpot:50", "e2el:1e4"]) == {"ttft": 500, "tpot": 50,
                                                              "e2el": 10000}
    for bad in (["ttft=500"], ["itl:5"]):
        with pytest.raises(ValueError):
            parse_slos(bad)


def test_output_timeline_bins():
    # request 0: chunks at 0.15 .. 1.05 (1 token each): 9 in bin 0, the one at 1.05 in bin 1;
    # request 1: chunks at 0.85, 0.95, 1.05 share 5 tokens: 10/3 in bin 0, 5/3 in bin 1;
    # request 2: its one chunk at 1.2 in bin 1. Bin 1 is 0.5 s wide (duration 1.5 s).
    timeline = output_timeline(hand_records(), duration=1.5)
    assert timeline == pytest.approx([9 + 10 / 3, (1 + 5 / 3 + 1) / 0.5])
    assert summarize(hand_records(), 1.5)["peak_output_throughput"] == pytest.approx(
        max(timeline))


def test_table_lists_every_number():
    s = summarize(hand_records(), duration=2.0, slos={"ttft": 250})
    table = format_table(s, "hand")
    for text in ("hand", "Successful requests", "1.50", "98.0", "Goodput", "ttft:250",
                 "TTFT", "280.00", "TPOT", "99.50", "ITL", "E2E"):
        assert text in table
    assert "-" in format_table(summarize([hand_records()[3]], 1.0)).split("TTFT")[1]


# ---------------------------------------------------------------- SSE parsing


STREAM = (
    ": a comment line\r\n"
    "event: message\r\n"
    'data: {"choices":[{"index":0,"text":"Hel"}]}\r\n'
    "\r\n"
    'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n'
    "id: 7\n"
    "\n"
    "data:{\"a\":\n"  # no space after the colon; data over two lines
    "data: 1}\n"
    "\n"
    "\n"  # an extra blank line is no event
    'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
    "data: [DONE]\n\n"
)
EVENTS = ['{"choices":[{"index":0,"text":"Hel"}]}',
          '{"choices":[{"index":0,"delta":{"content":"lo"}}]}',
          '{"a":\n1}',
          '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}',
          "[DONE]"]


@pytest.mark.parametrize("piece", [len(STREAM), 1, 3, 17])
def test_sse_decoder_any_split(piece):
    decoder = SSEDecoder()
    events = []
    for i in range(0, len(STREAM), piece):
        events += decoder.feed(STREAM[i:i + piece])
    assert events + decoder.flush() == EVENTS


def test_sse_flush_and_chunk_text():
    decoder = SSEDecoder()
    assert decoder.feed("data: x\n") == []
    assert decoder.flush() == ["x"]  # the stream ended without the blank line
    assert decoder.flush() == []
    assert chunk_text(json.loads(EVENTS[0])) == "Hel"
    assert chunk_text(json.loads(EVENTS[1])) == "lo"
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"reasoning_content": "hm"}}]}) == "hm"
    assert chunk_text(json.loads(EVENTS[3])) == ""


# ---------------------------------------------------------------- prompts and arrivals


def test_prompts_are_seeded_and_sized():
    args = bench_serving.parse_args(["--num-prompts", "50", "--input-len", "40",
                                     "--output-len", "10", "--range-ratio", "0.5",
                                     "--vocab-size", "1000"])
    first = bench_serving.random_requests(args, as_text=False)
    assert first == bench_serving.random_requests(args, as_text=False)
    for r in first:
        assert 20 <= r.prompt_len == len(r.prompt) <= 60 and 5 <= r.output_len <= 15
        assert all(0 <= t < 1000 for t in r.prompt)
    assert len({r.prompt_len for r in first}) > 5
    words = bench_serving.random_requests(args, as_text=True)
    assert [len(r.prompt.split()) for r in words] == [r.prompt_len for r in words]

    args = bench_serving.parse_args(["--dataset", "sharegpt-synthetic", "--num-prompts", "300",
                                     "--endpoint", "/v1/chat/completions"])
    share = bench_serving.sharegpt_synthetic_requests(args, as_text=True)
    assert share == bench_serving.sharegpt_synthetic_requests(args, as_text=True)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4
               and r.prompt_len + r.output_len <= 2048 for r in share)
    assert 100 < sum(r.prompt_len for r in share) / len(share) < 400


def test_arrivals_and_args():
    assert bench_serving.arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    offsets = bench_serving.arrival_offsets(2000, 50.0, 0)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)  # mean gap 1 / rate
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--endpoint", "/v1/chat/completions", "--prompt-type",
                                  "tokens"])
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--goodput", "latency:5"])


# ---------------------------------------------------------------- against a fake server

TTFT_S, ITL_S = 0.05, 0.02  # the fake's delay before the first token and between tokens
SSE_TYPE = "text/event-stream"


def compact_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class FakeServer(httpx.AsyncBaseTransport):
    """A tiny OpenAI-compatible streaming server: each request waits TTFT_S, then sends
    max_tokens one-token chunks ITL_S apart, then usage (unless turned off) and [DONE].
    Requests numbered in `fail_http` get HTTP 500; in `fail_stream`, an error event.
    In process it is an httpx transport (main(transport=...)); over_http() serves it."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.send_usage, self.fail_http, self.fail_stream = True, set(), set()

    async def respond(self, path: str, body: dict | None):
        """(status, JSON bytes) or (200, an async iterator of SSE text)."""
        if path == "/v1/models":
            return 200, compact_json({"object": "list", "data": [{"id": "fake-model"}]})
        number = len(self.bodies)
        self.bodies.append(body)
        if number in self.fail_http:
            return 500, compact_json({"error": {"message": "overloaded"}})
        chat = "messages" in body
        prompt = body["messages"][0]["content"].split() if chat else body["prompt"]

        def event(text: str, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text}} if chat
                      else {"index": 0, "text": text})
            return f"data: {json.dumps({'choices': [choice | {'finish_reason': finish}]})}\n\n"

        async def stream():
            if chat:
                yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
            n = body["max_tokens"]
            for i in range(n):
                await asyncio.sleep(TTFT_S if i == 0 else ITL_S)
                if number in self.fail_stream and i == 1:
                    yield 'data: {"error":{"message":"engine died"}}\n\n'
                    return
                yield event(f" t{i}", "length" if i == n - 1 else None)
            if self.send_usage:
                usage = {"prompt_tokens": len(prompt), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return 200, stream()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread()) if request.method == "POST" else None
        status, content = await self.respond(request.url.path, body)
        if isinstance(content, bytes):
            return httpx.Response(status, content=content,
                                  headers={"content-type": "application/json"})
        return httpx.Response(status, headers={"content-type": SSE_TYPE},
                              content=(text.encode() async for text in content))


@contextmanager
def over_http(fake: FakeServer):
    """Serve `fake` with uvicorn on a free local port, in a thread; yields the base URL."""

    async def endpoint(request: Request):
        body = await request.json() if request.method == "POST" else None
        status, content = await fake.respond(request.url.path, body)
        if isinstance(content, bytes):
            return Response(content, status_code=status, media_type="application/json")
        return StreamingResponse(content, media_type=SSE_TYPE)

    app = Starlette(routes=[Route("/v1/models", endpoint),
                            Route("/v1/completions", endpoint, methods=["POST"]),
                            Route("/v1/chat/completions", endpoint, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the fake server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
    assert not thread.is_alive()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock moves only while every task waits: where a real loop would
    block in select() for the time left to its next timer, this one adds that time to its clock
    and goes on. Sleeps take no real time, so a duration measured on loop.time() is exactly the
    sum of the sleeps on its path, however busy the machine."""

    def __init__(self) -> None:
        self.now = 0.0
        loop = self

        class Selector(selectors.DefaultSelector):
            def select(self, timeout=None):
                events = super().select(0)  # the loop's own wake-up pipe; no sockets here
                if not events and timeout is None:  # no timer left: every task waits forever
                    raise RuntimeError("deadlock: every task waits and no timer is set")
                if not events:
                    loop.now += timeout
                return events

        super().__init__(Selector())

    def time(self) -> float:
        return self.now


def test_virtual_time_loop_adds_up_the_sleeps():
    async def sleeper(seconds: float, log: list):
        await asyncio.sleep(seconds)
        log.append((seconds, asyncio.get_running_loop().time()))

    async def both() -> list:
        log: list = []
        await asyncio.gather(sleeper(0.3, log), sleeper(0.1, log))
        await asyncio.sleep(2.0)
        return log + [(None, asyncio.get_running_loop().time())]

    real_start = time.monotonic()  # (real time: an upper bound far above what it takes)
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        log = runner.run(both())
    assert [who for who, _ in log] == [0.1, 0.3, None]
    assert [when for _, when in log] == pytest.approx([0.1, 0.3, 2.3], abs=1e-12)
    assert time.monotonic() - real_start < 2.0  # the 2 s sleep took no real time


@pytest.fixture
def fake():
    return FakeServer()


def run_virtual(fake: FakeServer, argv: list[str]) -> dict:
    return bench_serving.main(["--base-url", "http://fake"] + argv, transport=fake,
                              loop_factory=VirtualTimeLoop)


def ms(seconds: float) -> float:
    return seconds * 1000


def test_completions_run_matches_fake_timing(fake, tmp_path, capsys):
    n_tokens, num = 5, 8
    result = run_virtual(fake, [
        "--num-prompts", str(num), "--input-len", "12", "--output-len", str(n_tokens),
        "--max-concurrency", "4", "--goodput", "ttft:50", "tpot:20", "--result-json",
        str(tmp_path / "r.json"), "--plot-dir", str(tmp_path / "plots")])
    s = result["summary"]
    # the fake's times, exactly (virtual clock): an SLO of exactly the fake's TTFT and TPOT is
    # met (equal is good)
    assert (s["completed"], s["failed"], s["good_requests"]) == (num, 0, num)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (12 * num, n_tokens * num)
    e2e = TTFT_S + (n_tokens - 1) * ITL_S  # 130 ms
    exact = {"mean": None, "median": None, "p90": None, "p99": None}
    for name, value in (("ttft_ms", TTFT_S), ("itl_ms", ITL_S), ("tpot_ms", ITL_S),
                        ("e2el_ms", e2e)):
        assert s[name] == pytest.approx(dict.fromkeys(exact, ms(value)), abs=1e-6), name
    # 8 requests, 4 at a time: the second wave starts as the first ends
    assert s["duration_s"] == pytest.approx(2 * e2e, abs=1e-9)
    assert result["requests"]["start_s"] == pytest.approx([0.0] * 4 + [e2e] * 4, abs=1e-9)
    assert s["request_throughput"] == pytest.approx(num / (2 * e2e))
    assert s["output_throughput"] == pytest.approx(n_tokens * num / (2 * e2e))

    body = fake.bodies[0]
    assert body["model"] == "fake-model" and body["max_tokens"] == n_tokens
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert len(body["prompt"]) == 12 and all(isinstance(t, int) for t in body["prompt"])

    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"] == s
    assert saved["config"]["model"] == "fake-model" and saved["config"]["request_rate"] == "inf"
    itl = saved["requests"]["itl_ms"]
    assert [len(gaps) for gaps in itl] == [n_tokens - 1] * num
    assert [gap for gaps in itl for gap in gaps] == pytest.approx(
        [ms(ITL_S)] * (n_tokens - 1) * num, abs=1e-6)
    for name in ("latency_cdf.png", "throughput.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Successful requests" in capsys.readouterr().out


def test_a_tighter_slo_than_the_fake_meets_no_request(fake):
    s = run_virtual(fake, ["--num-prompts", "3", "--input-len", "4", "--output-len", "3",
                           "--goodput", f"ttft:{ms(TTFT_S) - 0.01}"])["summary"]
    assert (s["completed"], s["good_requests"], s["goodput"]) == (3, 0, 0)


def test_chat_run_over_http_counts_chunks_and_failures(fake):
    fake.send_usage, fake.fail_http, fake.fail_stream = False, {1}, {2}
    with over_http(fake) as url:
        result = bench_serving.main([
            "--base-url", url, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
            "--input-len", "7", "--output-len", "4", "--no-ignore-eos", "--model", "m",
            "--goodput", "e2el:1"])
    s = result["summary"]
    assert (s["completed"], s["failed"], s["good_requests"]) == (4, 2, 0)
    assert s["total_output_tokens"] == 4 * 4  # no usage: one token per content chunk
    assert s["total_input_tokens"] == 4 * 7  # the word count the prompts were built with
    # real time: only a lower bound holds on a busy machine. The role chunk comes at once: a
    # TTFT taken from it would be far below the fake's delay.
    assert s["ttft_ms"]["median"] >= ms(TTFT_S)
    errors = sorted(e for e in result["requests"]["error"] if e)
    assert errors == ["HTTP 500: {\"error\":{\"message\":\"overloaded\"}}", "engine died"]
    body = fake.bodies[0]
    assert "ignore_eos" not in body and body["model"] == "m"
    assert len(body["messages"][0]["content"].split()) == 7


def test_chat_ttft_skips_the_role_chunk_exactly(fake):
    result = run_virtual(fake, ["--endpoint", "/v1/chat/completions", "--num-prompts", "2",
                                "--input-len", "3", "--output-len", "3"])
    assert result["requests"]["ttft_ms"] == pytest.approx([ms(TTFT_S)] * 2, abs=1e-6)


def test_poisson_arrivals_follow_schedule(fake):
    result = run_virtual(fake, ["--num-prompts", "6", "--input-len", "4", "--output-len", "2",
                                "--request-rate", "5", "--seed", "3"])
    expected = bench_serving.arrival_offsets(6, 5.0, 3)
    assert min(b - a for a, b in zip(expected, expected[1:])) > 0.01  # a schedule to check
    assert result["requests"]["start_s"] == pytest.approx(expected, abs=1e-9)
    assert result["config"]["request_rate"] == 5.0
