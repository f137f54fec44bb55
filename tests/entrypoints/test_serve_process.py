"""`python -m echo serve` as a real process: the openai client, disconnects, SIGTERM."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *extra: str):
    """Start `python -m echo serve` and wait until /health answers; yields (proc, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "echo", "serve", "--model", model, "--device", "cpu",
           "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "512",
           "--shutdown-timeout", "20", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise TimeoutError("server did not become healthy")
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.fixture
def server(tiny_chat_model):
    yield from start_server(str(tiny_chat_model), "--num-gpu-blocks-override", "256")


def stats(base: str) -> dict:
    text = httpx.get(f"{base}/metrics").text
    values = {}
    for line in text.splitlines():
        if line.startswith("echo_num_requests_running") or line.startswith("echo_kv_cache"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def test_openai_client_disconnect_and_graceful_sigterm(server):
    from openai import OpenAI

    proc, base = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5

    # a client that disconnects mid-stream has its request aborted
    with httpx.stream("POST", f"{base}/v1/completions", json={
            "model": "tiny", "prompt": "a", "max_tokens": 400, "ignore_eos": True,
            "stream": True}, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    for _ in range(100):
        if stats(base).get("echo_num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert stats(base)["echo_num_requests_running"] == 0

    # SIGTERM lets an in-flight request finish, then the server exits 0
    with httpx.stream("POST", f"{base}/v1/completions", json={
            "model": "tiny", "prompt": "b", "max_tokens": 60, "ignore_eos": True,
            "stream": True}, timeout=60) as r:
        lines = iter(r.iter_lines())
        next(lines)
        os.kill(proc.pid, signal.SIGTERM)
        rest = list(lines)
    assert "data: [DONE]" in rest
    assert proc.wait(60) == 0
