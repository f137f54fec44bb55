"""Load against `python -m echo serve` on SmolLM2 (slow: .ci/run runs it after `make test`):
500 concurrent streams with a quarter of the clients leaving at random moments, then the
EngineCore killed under the server."""

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from echo.models.default_model import ensure_default_model
from tests.engine.test_multiprocess import alive, child_pids, wait_gone
from tests.entrypoints.test_hostile_requests import metric, rss_bytes
from tests.entrypoints.test_serve_process import cmdline, start_server

pytestmark = pytest.mark.slow

STREAMS = 500
MAX_TOKENS = 16


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        children = child_pids(frontier.pop())
        found += children
        frontier += children
    return found


async def one_stream(http: httpx.AsyncClient, i: int, leave_after: int | None):
    """The stream's events, or None when this client left after `leave_after` events."""
    body = {"model": "tiny", "prompt": f"Story number {i}:", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": i}
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line or line.startswith(":"):  # SSE comments: keep-alive pings
                continue
            events.append(line)
            if leave_after is not None and len(events) >= leave_after:
                return None
    return events


def run_streams(base: str, count: int, seed: int) -> list:
    rng = random.Random(seed)
    leaving = {i: rng.randint(1, MAX_TOKENS) for i in rng.sample(range(count), count // 4)}

    async def main():
        limits = httpx.Limits(max_connections=count + 10)
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
            return await asyncio.gather(*(one_stream(http, i, leaving.get(i))
                                          for i in range(count)))

    return asyncio.run(main())


def wait_until_idle(base: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while (metric(base, "vllm:num_requests_running") or
           metric(base, "vllm:kv_cache_usage_perc")):
        assert time.monotonic() < deadline, "requests or KV blocks still held"
        time.sleep(0.1)


def test_500_streams_with_disconnects_then_the_engine_killed():
    ensure_default_model()
    server = start_server("default", "--max-num-seqs", "64", "--num-gpu-blocks-override",
                          "512")
    proc, base = next(server)
    try:
        run_streams(base, 100, seed=1)  # warm-up: the allocator's pools exist before "before"
        wait_until_idle(base)
        before = rss_bytes(proc.pid)
        results = run_streams(base, STREAMS, seed=0)
        completed = [r for r in results if r is not None]
        assert len(completed) == STREAMS - STREAMS // 4  # every other client saw no error
        for events in completed:
            assert events[-1] == "data: [DONE]"
            chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
            assert "error" not in chunks[-1]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        wait_until_idle(base)
        assert rss_bytes(proc.pid) < 1.1 * before, (rss_bytes(proc.pid), before)

        # the EngineCore killed: /health says so at once, the server exits 1, nothing is left
        processes = descendants(proc.pid)
        cores = [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]
        assert len(cores) == 1
        os.kill(cores[0], signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 503:
                    break
            except httpx.HTTPError:
                break  # already stopped serving: that is past 503
            assert time.monotonic() - killed < 1.0, "/health did not turn 503 within 1 s"
            time.sleep(0.02)
        assert proc.wait(5) == 1
        assert time.monotonic() - killed < 5.0
        assert wait_gone(processes, 5) == [], [p for p in processes if alive(p)]
    finally:
        server.close()  # kills the server if it is still running
