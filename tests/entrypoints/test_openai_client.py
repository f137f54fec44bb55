"""The real server on SmolLM2 (CPU), driven by the official `openai` client, plus a load test
with disconnecting clients."""

import asyncio
import json
import random

import httpx
import openai
import pytest

from tests.entrypoints.test_serve_process import start_server

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smol_server():
    from echo.models.default_model import ensure_default_model

    ensure_default_model()
    yield from start_server("default", "--dtype", "float32", "--max-num-seqs", "256")


@pytest.fixture(scope="module")
def client(smol_server):
    _, base = smol_server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


def test_chat_answers_and_streaming_equals_whole(client):
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=32,
                                           temperature=0)
    answer = whole.choices[0].message.content
    assert "Paris" in answer and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}


def test_completion_usage_stop_and_streaming(client):
    prompt = "The three primary colors are"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                      temperature=0)
    text = whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True) if c.choices)
    assert streamed == text
    from transformers import AutoTokenizer

    from echo.models.default_model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    assert whole.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(tokenizer.encode(text,
                                                                 add_special_tokens=False)) \
        or whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + \
        whole.usage.completion_tokens
    stop = text.strip().split()[1]
    stopped = client.completions.create(model="tiny", prompt=prompt, max_tokens=20,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_n_seed_and_logprobs(client):
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8,
              "temperature": 1.0, "seed": 1234}
    a = client.completions.create(n=2, logprobs=3, **kwargs)
    b = client.completions.create(n=2, logprobs=3, **kwargs)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert sorted(c.index for c in a.choices) == [0, 1]
    for choice in a.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(len(top) == 3 for top in lp.top_logprobs)
        assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    entries = chat.choices[0].logprobs.content
    assert len(entries) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)


@pytest.mark.parametrize("kwargs,error,field", [
    ({"temperature": -0.5}, openai.BadRequestError, "temperature"),
    ({"top_p": 1.5}, openai.BadRequestError, "top_p"),
    ({"max_tokens": 100_000}, openai.BadRequestError, "max_tokens"),
    ({"model": "gpt-4"}, openai.NotFoundError, "model"),
    ({"n": 0}, openai.BadRequestError, "n"),
])
def test_errors_have_status_and_message_then_next_request_works(client, kwargs, error, field):
    request = {"model": "tiny", "messages": CHAT, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as info:
        client.chat.completions.create(**request)
    body = info.value.body
    assert body["param"] == field and body["message"]
    if field == "max_tokens":
        assert "maximum context length is 512" in body["message"]
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert ok.usage.completion_tokens == 2


@pytest.mark.slow  # a load test (56 s on 2 cores): .ci/run runs it after make test
def test_200_streams_with_50_disconnects_leave_the_server_clean(smol_server):
    _, base = smol_server
    rng = random.Random(0)
    drop = set(rng.sample(range(200), 50))

    async def one(http, i):
        body = {"model": "tiny", "prompt": f"Story number {i}:", "max_tokens": 24,
                "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": i}
        events = []
        async with http.stream("POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line or line.startswith(":"):  # SSE comments: the keep-alive pings
                    continue
                events.append(line)
                if i in drop and len(events) >= rng.randint(1, 10):
                    return None  # disconnect mid-stream
        return events

    async def main():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*(one(http, i) for i in range(200)))

    results = asyncio.run(main())
    completed = [r for r in results if r is not None]
    assert len(completed) >= 150
    for events in completed:
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    # afterwards nothing runs and no KV block is held
    for _ in range(100):
        metrics = httpx.get(f"{base}/metrics").text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines()
                  if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))}
        if values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert values == {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0}
    assert httpx.get(f"{base}/health").status_code == 200
