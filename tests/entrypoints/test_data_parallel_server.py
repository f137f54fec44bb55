"""`echo serve --data-parallel-size 2` as a process: metrics per replica (engine="0", "1"),
/health degraded while a killed replica restarts and requests keep succeeding on the other,
and exit status 1 once no replica is left."""

import os
import signal
import time

import httpx
import pytest

from tests.engine.test_multiprocess import child_pids, wait_gone
from tests.entrypoints.test_serve_process import start_server


def _complete(base: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                            "temperature": 0, "ignore_eos": True})


def _core_pids(server_pid: int) -> list[int]:
    """The server's EngineCore processes: its children that have children (their workers)."""
    return sorted(pid for pid in child_pids(server_pid) if child_pids(pid))


def _wait(predicate, seconds: float):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.2)
    raise TimeoutError(f"not within {seconds} s")


def _generation_tokens(base: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("vllm:generation_tokens_total{"):
            engine = line.split('engine="')[1].split('"')[0]
            values[engine] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.mark.slow  # end to end: make test-slow (make test's budget)
def test_two_replicas_behind_one_server(tiny_chat_model):
    gen = start_server(str(tiny_chat_model), "--data-parallel-size", "2", "--router-policy",
                       "round_robin", "--num-gpu-blocks-override", "256")
    proc, base = next(gen)
    try:
        cores = _wait(lambda: len(_core_pids(proc.pid)) == 2 and _core_pids(proc.pid), 30)
        assert [_complete(base, f"hello {i}").status_code for i in range(4)] == [200] * 4
        # round robin: two requests of 3 tokens each on each replica
        assert _generation_tokens(base) == {"0": 6.0, "1": 6.0}

        os.kill(cores[1], signal.SIGKILL)
        health = _wait(lambda: (r := httpx.get(f"{base}/health")).headers.get(
            "content-type", "").startswith("application/json") and r, 10)
        assert health.status_code == 200
        assert health.json()["status"] == "degraded"
        assert health.json()["replicas"][0] == "serving"
        # the survivor takes every request meanwhile
        assert [_complete(base, f"again {i}").status_code for i in range(3)] == [200] * 3
        _wait(lambda: httpx.get(f"{base}/health").content == b"", 60)  # serving again
        assert _complete(base, "back").status_code == 200

        # no replica left: the server stops with 1 (a supervisor restarts it)
        cores = _wait(lambda: len(_core_pids(proc.pid)) == 2 and _core_pids(proc.pid), 10)
        for pid in cores:
            os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert wait_gone(cores, 10) == []
    finally:
        gen.close()
