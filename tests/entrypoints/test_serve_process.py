"""`python -m echo serve` as a real process: the openai client, disconnects, SIGTERM."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

# each test starts its own server process (about 20 s apiece on 2 cores): make test-slow
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *extra: str, names: tuple[str, ...] = ("tiny",),
                 model_flag: bool = True):
    """Start `python -m echo serve` (the model as --model, or positional as `vllm serve MODEL`)
    and wait until /health answers; yields (proc, base url)."""
    port = free_port()
    cmd = [sys.executable, "-m", "echo", "serve", *(["--model"] if model_flag else []), model,
           "--device", "cpu", "--port", str(port), "--served-model-name", *names,
           "--max-model-len", "512", "--shutdown-timeout", "20", "--log-level", "warning",
           *extra]
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
        if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc")):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


def wait_idle(base: str, timeout_s: float = 10.0) -> bool:
    """Whether /metrics reaches zero running requests (stats arrive with the core's outputs)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if stats(base).get("vllm:num_requests_running") == 0:
            return True
        time.sleep(0.1)
    return False


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
    assert wait_idle(base)

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
    log = proc.stdout.read()
    assert "Traceback" not in log and "Error" not in log, log[-2000:]  # a quiet exit


@pytest.fixture
def tp2_server(tiny_chat_model):
    yield from start_server(str(tiny_chat_model), "--tp", "2", "--num-gpu-blocks-override", "256")


def test_tp2_server_streams_concurrent_requests_like_one_rank(tiny_chat_model, tp2_server):
    import asyncio

    from echo import LLM, SamplingParams

    prompts = [f"Count to {i}:" for i in range(24)]
    reference = LLM(str(tiny_chat_model), device="cpu", max_model_len=512,
                    num_gpu_blocks_override=256).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    _, base = tp2_server

    async def stream(http, prompt) -> str:
        text = ""
        async with http.stream("POST", "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[len("data: "):])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=120) as http:
            return await asyncio.gather(*(stream(http, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in reference]
    assert wait_idle(base)


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace")


def test_server_exits_1_when_its_engine_dies(tiny_chat_model):
    from tests.engine.test_multiprocess import child_pids, wait_gone

    server = start_server(str(tiny_chat_model), "--tp", "2", "--num-gpu-blocks-override", "64")
    proc, _ = next(server)
    try:
        # the EngineCore, not the resource tracker multiprocessing may have started
        cores = [p for p in child_pids(proc.pid) if "resource_tracker" not in cmdline(p)]
        assert len(cores) == 1
        workers = child_pids(cores[0])
        os.kill(cores[0], signal.SIGKILL)
        # a supervisor sees the process end, instead of a server answering 503 forever
        assert proc.wait(30) == 1
        assert "the engine died" in proc.stdout.read()
        assert wait_gone(workers, 10) == []
    finally:
        server.close()  # kills the server if it is still running
