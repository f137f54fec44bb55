"""A hostile corpus against `python -m echo serve` on SmolLM2: every request is answered within
10 s with an OpenAI-shaped 4xx or a valid 200, nothing is a 5xx, the API process's memory stays
under twice its idle size, and a valid request still succeeds afterwards."""

import json
import socket
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from echo.entrypoints.request_limits import MAX_STOP_STRINGS
from echo.models.default_model import ensure_default_model
from tests.entrypoints.test_serve_process import start_server

MAX_NUM_SEQS = 8
LIMIT_S = 10.0
CHAT = [{"role": "user", "content": "Hi"}]
DEEP = json.loads('{"type": "array", "items": ' * 100 + '{}' + "}" * 100)  # a schema too deep


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": CHAT, "max_tokens": 2, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hi", "max_tokens": 2, **fields}


# (name, path, body): a dict is sent as JSON, bytes as they are
WRONG_TYPES = [(f"wrong type: {field}", "/v1/chat/completions", chat(**{field: value}))
               for field, value in [
                   ("temperature", "hot"), ("top_p", []), ("top_k", 1.5), ("min_p", {}),
                   ("n", "many"), ("max_tokens", "x"), ("stream", "maybe"), ("stop", 5),
                   ("seed", "x"), ("logprobs", "x"), ("top_logprobs", "x"),
                   ("presence_penalty", "x"), ("frequency_penalty", []),
                   ("repetition_penalty", "x"), ("stop_token_ids", "x"), ("messages", "hi"),
                   ("messages", [1]), ("messages", [{"role": "bogus", "content": "x"}]),
                   ("min_tokens", "x"), ("ignore_eos", "x"), ("stream_options", 3),
               ]] + [
    ("wrong type: prompt", "/v1/completions", completion(prompt=5)),
    ("wrong type: prompt object", "/v1/completions", completion(prompt={"a": 1})),
]
CORPUS = WRONG_TYPES + [
    ("n = 10^6", "/v1/chat/completions", chat(n=10**6)),
    ("n = 10^6 streamed", "/v1/completions", completion(n=10**6, stream=True)),
    ("n = 10^400", "/v1/completions", completion(n=10**400)),
    ("best_of = 10^6", "/v1/completions", completion(best_of=10**6)),
    ("lone high surrogate", "/v1/chat/completions",
     b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'),
    ("lone low surrogate in a prompt", "/v1/completions",
     b'{"prompt": "\\udc00", "max_tokens": 2}'),
    ("lone surrogate in a text part", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}'),
    ("invalid UTF-8 bytes", "/v1/completions", b'{"prompt": "\xff\xfe\xc3", "max_tokens": 2}'),
    ("10^5 stop strings", "/v1/completions", completion(stop=["x"] * 10**5)),
    ("a stop string of 10^5 characters", "/v1/completions", completion(stop=["s" * 10**5])),
    ("10^5 stop token ids", "/v1/completions", completion(stop_token_ids=[1] * 10**5)),
    ("stop token id out of the vocabulary", "/v1/completions",
     completion(stop_token_ids=[10**12])),
    ("deeply nested JSON", "/v1/completions", b"[" * 100_000 + b"]" * 100_000),
    ("deeply nested extra field", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x", "deep": ' + b"[" * 5000 + b"]" * 5000
     + b"}]}"),
    ("10^5 logit_bias entries", "/v1/completions",
     completion(logit_bias={str(i): 1.0 for i in range(10**5)})),
    ("logprobs = 10^6", "/v1/completions", completion(logprobs=10**6)),
    ("top_logprobs = 10^6", "/v1/chat/completions", chat(logprobs=True, top_logprobs=10**6)),
    ("max_tokens = 10^18", "/v1/completions", completion(max_tokens=10**18)),
    ("max_tokens < 0", "/v1/completions", completion(max_tokens=-5)),
    ("min_tokens > max_tokens", "/v1/completions", completion(min_tokens=50)),
    ("seed = 2^80", "/v1/completions", completion(seed=2**80)),
    ("temperature NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}'),
    ("temperature 1e999", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}'),
    ("top_k = 10^12", "/v1/completions", completion(top_k=10**12, temperature=1)),
    ("10^6 prompt token ids", "/v1/completions", completion(prompt=[1] * 10**6)),
    ("token id out of the vocabulary", "/v1/completions", completion(prompt=[1, 10**9])),
    ("10^5 prompts", "/v1/completions", completion(prompt=["a"] * 10**5)),
    ("10^5 messages", "/v1/chat/completions", chat(messages=CHAT * 10**5)),
    ("10^5 text parts", "/v1/chat/completions", chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 10**5}])),
    ("a 10 MB prompt", "/v1/completions", completion(prompt="word " * 2 * 10**6)),
    ("a lone surrogate to /tokenize", "/tokenize", b'{"prompt": "\\ud800"}'),
    ("10^6 ids to /detokenize", "/detokenize", {"tokens": [1] * 10**6}),
    ("an id out of the vocabulary to /detokenize", "/detokenize", {"tokens": [10**9]}),
    ("an empty prompt", "/v1/completions", completion(prompt="")),
    ("no prompt", "/v1/completions", {"max_tokens": 2}),
    ("an empty body", "/v1/completions", b""),
    ("not JSON", "/v1/completions", b"hello"),
    ("a JSON array", "/v1/chat/completions", b"[]"),
    ("JSON null", "/v1/chat/completions", b"null"),
    ("a 1 MB model name", "/v1/completions", completion(model="m" * 2**20)),
    ("tools, auto choice, on a server without a tool-call parser", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}])),
    ("response_format json_object", "/v1/chat/completions",
     chat(response_format={"type": "json_object"})),
    ("a 1 MB JSON schema", "/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {f"p{i}": {"type": "string"}
                                             for i in range(40_000)}}}})),
    ("a schema nested 100 deep", "/v1/chat/completions", chat(guided_json=DEEP)),
    ("10^5 choices", "/v1/completions", completion(guided_choice=["x"] * 10**5)),
    ("a regex that does not parse", "/v1/completions", completion(guided_regex="(" * 1000)),
    ("two constraints at once", "/v1/completions",
     completion(guided_regex="a", structured_outputs={"choice": ["b"]})),
    ("stream_options without stream", "/v1/completions",
     completion(stream_options={"include_usage": True})),
    ("10^4 unknown fields", "/v1/completions", completion(**{f"x{i}": i for i in range(10**4)})),
    ("tool messages", "/v1/chat/completions",
     chat(messages=[{"role": "tool", "content": "x"}] * 3)),
    (f"{MAX_STOP_STRINGS} stop strings (the limit)", "/v1/completions",
     completion(stop=[f"stop{i}" for i in range(MAX_STOP_STRINGS)])),
]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def send(http: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def chunked_upload(base: str, total_bytes: int) -> bytes:
    """POST total_bytes of JSON-looking body with chunked transfer encoding over a raw socket,
    reading the answer while sending (the server answers before the body ends)."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=LIMIT_S)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"prompt": "' + b"a" * (2**20 - 12)

    def pump() -> None:
        try:
            sent = 0
            while sent < total_bytes:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: what this test wants

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    try:
        return sock.recv(65536)
    finally:
        sock.close()
        sender.join(LIMIT_S)


@pytest.fixture(scope="module")
def smollm2_server():
    ensure_default_model()
    yield from start_server("default", "--max-num-seqs", str(MAX_NUM_SEQS),
                            "--num-gpu-blocks-override", "256", "--max-model-len", "1100")


@pytest.mark.slow  # a load check: the whole corpus against one server
def test_hostile_corpus_gets_4xx_or_200_quickly_with_bounded_memory(smollm2_server):
    proc, base = smollm2_server
    assert len(CORPUS) >= 40
    with httpx.Client(base_url=base, timeout=LIMIT_S + 5) as http:
        assert http.post("/v1/chat/completions", json=chat()).status_code == 200
        idle = rss_bytes(proc.pid)
        peak = idle
        for name, path, body in CORPUS:
            start = time.monotonic()
            r = send(http, path, body)
            took = time.monotonic() - start
            peak = max(peak, rss_bytes(proc.pid))
            assert took < LIMIT_S, (name, took)
            assert r.status_code == 200 or 400 <= r.status_code < 500, (name, r.status_code,
                                                                         r.text[:300])
            if r.status_code == 200:
                body = r.json()
                assert body["choices"] if path.startswith("/v1") else body, (name, r.text[:200])
            else:
                error = r.json()["error"]  # OpenAI's shape, never FastAPI's {"detail": ...}
                assert error["code"] == r.status_code and error["message"], name
        start = time.monotonic()
        answer = chunked_upload(base, 64 * 2**20)
        assert time.monotonic() - start < LIMIT_S
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        peak = max(peak, rss_bytes(proc.pid))
        assert peak < 2 * idle, (peak, idle)
        ok = http.post("/v1/chat/completions", json=chat(max_tokens=4))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_limits_name_their_field(smollm2_server):
    _, base = smollm2_server
    cases = [
        (completion(n=MAX_NUM_SEQS + 1), "n"), (completion(best_of=10**6), "best_of"),
        (completion(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
        (completion(stop_token_ids=[10**12]), "stop_token_ids"),
        (completion(prompt=["a"] * 10**5), "prompt"), (completion(prompt=[1] * 10**6), "prompt"),
        (chat(messages=CHAT * 10**5), "messages"), (completion(min_tokens=50), "min_tokens"),
        (completion(temperature=-1), "temperature"),
        # vLLM fields echo cannot honour: refused, not silently sampled
        (completion(use_beam_search=True), "use_beam_search"),
        (chat(use_beam_search=True), "use_beam_search"),
        (completion(prompt_embeds="AAAA"), "prompt_embeds"),
        # a forced tool call compiles the tools' parameter schemas: an error names the tool
        (chat(tools=[tool("f", {}), tool("g", DEEP)],
              tool_choice={"type": "function", "function": {"name": "g"}}),
         "tools[1].function.parameters"),
        (chat(tools=[tool("f", {}), tool("g", DEEP)], tool_choice="required"), "tools"),
    ]
    with httpx.Client(base_url=base, timeout=LIMIT_S) as http:
        for body, field in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = http.post(path, json=body)
            assert r.status_code == 400, (field, r.text[:200])
            assert r.json()["error"]["param"] == field, (field, r.json())
        surrogate = http.post("/v1/chat/completions", content=json.dumps(
            {"messages": [{"role": "user", "content": "\ud800"}]}),
            headers={"content-type": "application/json"})
        assert surrogate.status_code == 400
        assert surrogate.json()["error"]["param"] == "messages[0].content"
        assert http.get("/v1/nope").json()["error"]["code"] == 404
        assert http.get("/v1/completions").json()["error"]["code"] == 405


def metric(base: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no {name} {labels}")


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(smollm2_server):
    _, base = smollm2_server
    aborted = metric(base, "vllm:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": "Tell me a long story.", "max_tokens": 1000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=1.0)  # gives up after 1 s
    left = time.monotonic()
    while metric(base, "vllm:num_requests_running") != 0:
        assert time.monotonic() - left < 2.0, "the request still runs 2 s after its client left"
        time.sleep(0.05)
    assert metric(base, "vllm:request_success_total", finished_reason="abort") == aborted + 1
