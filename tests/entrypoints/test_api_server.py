"""The OpenAI-compatible server, in-process over ASGI, against a real engine process."""

import asyncio
import json

import httpx
import pytest

from echo import LLM, SamplingParams
from echo.engine.async_client import AsyncClient
from echo.entrypoints.api_server import create_app

ENGINE_ARGS = {"device": "cpu", "num_gpu_blocks_override": 256, "max_num_seqs": 8,
               "max_model_len": 256}
NAME = "tiny"


def with_server(folder, test, api_key=None, max_request_bytes=1 << 20):
    """Start the engine, build the app, run `test(http)` against it, stop everything."""

    async def main():
        async with AsyncClient(str(folder), **ENGINE_ARGS) as client:
            app = create_app(client, [NAME], api_key, max_request_bytes)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test",
                                         timeout=60) as http:
                return await test(http, client)

    return asyncio.run(main())


def sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_completion_matches_offline_llm_and_reports_usage(tiny_chat_model):
    prompt = "The capital of France is"
    offline = LLM(str(tiny_chat_model), **ENGINE_ARGS).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    async def test(http, client):
        r = await http.post("/v1/completions", json={
            "model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        return r

    r = with_server(tiny_chat_model, test)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == offline[0].outputs[0].text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["prompt_tokens"] == len(offline[0].prompt_token_ids)


def test_chat_stream_has_role_deltas_finish_and_usage(tiny_chat_model):
    async def test(http, client):
        body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}],
                "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        r = await http.post("/v1/chat/completions", json=body)
        whole = await http.post("/v1/chat/completions", json={
            **body, "stream": False, "stream_options": None})
        return r, whole

    r, whole = with_server(tiny_chat_model, test)
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    choices = [c["choices"][0] for c in chunks[1:-1]]
    # finish_reason only in the last content chunk
    assert [c["finish_reason"] for c in choices][:-1] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    streamed = "".join(c["delta"].get("content", "") for c in choices)
    assert streamed == whole.json()["choices"][0]["message"]["content"]


def test_logprobs_n_and_stop_strings(tiny_chat_model):
    async def test(http, client):
        free = await http.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        text = free.json()["choices"][0]["text"]
        stop = text[len(text) // 2:len(text) // 2 + 2]
        stopped = await http.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "stop": [stop]})
        sampled = await http.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 5, "n": 3, "seed": 11,
            "logprobs": 2, "ignore_eos": True})
        return text, stop, stopped, sampled

    text, stop, stopped, sampled = with_server(tiny_chat_model, test)
    choice = stopped.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    choices = sampled.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1, 2]
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5
        assert all(len(top) == 2 for top in lp["top_logprobs"])
        assert all(v <= 0 for v in lp["token_logprobs"])


@pytest.mark.parametrize("body,status,field", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
    ({"prompt": "x", "model": "other"}, 404, "model"),
    ({"prompt": "x", "echo": True, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({"max_tokens": 3}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),  # the engine refuses an empty prompt: a 400, not a 500
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "x", "n": "many"}, 400, "n"),
])
def test_bad_requests_get_openai_errors_and_engine_keeps_serving(tiny_chat_model, body, status,
                                                                 field):
    async def test(http, client):
        bad = await http.post("/v1/completions", json=body)
        good = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                        "ignore_eos": True})
        return bad, good

    bad, good = with_server(tiny_chat_model, test)
    assert bad.status_code == status, bad.text
    error = bad.json()["error"]
    assert error["param"] == field and error["message"]
    if body.get("max_tokens") == 1000:
        assert "maximum context length is 256" in error["message"]
    assert good.status_code == 200


def test_chat_requests_echo_cannot_honour_are_refused_by_name(tiny_chat_model):
    user = {"role": "user", "content": "hi"}
    image = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}
    cases = [({"messages": [user], "response_format": {"type": "yaml"}},
              "response_format.type"),
             ({"messages": [user, image]}, "messages[1].content"),
             ({"messages": [user], "top_logprobs": 2}, "top_logprobs"),
             ({"messages": [user], "stream_options": {"include_usage": True}},
              "stream_options")]

    async def test(http, client):
        bad = [await http.post("/v1/chat/completions", json=body) for body, _ in cases]
        good = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "response_format": {"type": "text"}, "max_tokens": 2, "ignore_eos": True})
        return bad, good

    bad, good = with_server(tiny_chat_model, test)
    for response, (_, field) in zip(bad, cases):
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field
        assert field in response.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_api_key_body_limit_models_health_metrics(tiny_chat_model):
    async def test(http, client):
        no_key = await http.get("/v1/models")
        models = await http.get("/v1/models", headers={"Authorization": "Bearer k"})
        one = await http.get(f"/v1/models/{NAME}", headers={"Authorization": "Bearer k"})
        other = await http.get("/v1/models/org/other", headers={"Authorization": "Bearer k"})
        big = await http.post("/v1/completions", content=b"x" * 5000,
                              headers={"Authorization": "Bearer k",
                                       "Content-Type": "application/json"})
        ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3,
                                                      "ignore_eos": True},
                             headers={"Authorization": "Bearer k"})
        health = await http.get("/health")
        metrics = await http.get("/metrics")
        return no_key, models, big, ok, health, metrics, one, other

    no_key, models, big, ok, health, metrics, one, other = with_server(
        tiny_chat_model, test, api_key="k", max_request_bytes=4096)
    assert no_key.status_code == 401
    assert models.json()["data"][0]["id"] == NAME
    # OpenAI's retrieve: the same card, or a 404 naming the model
    assert one.json() == models.json()["data"][0]
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    assert "org/other" in other.json()["error"]["message"]
    assert big.status_code == 413
    assert ok.status_code == 200 and health.status_code == 200
    text = metrics.text
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 3.0' in text
    assert "vllm:time_to_first_token_seconds_count" in text
    assert "vllm:kv_cache_usage_perc" in text


def test_health_is_503_when_the_engine_is_dead(tiny_chat_model):
    import os

    async def test(http, client):
        os.kill(client.proc.pid, 9)
        client.proc.join(10)
        health = await http.get("/health")
        completion = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        return health, completion

    health, completion = with_server(tiny_chat_model, test)
    assert health.status_code == 503 and completion.status_code == 503


def test_return_token_ids_streams_every_token_of_a_model_without_tokenizer(tiny_llama):
    # no tokenizer: the text stays empty, so ids are the only way to see (and time) tokens
    prompt = [5, 9, 2, 7]
    offline = LLM(str(tiny_llama), **ENGINE_ARGS).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    expected = list(offline[0].outputs[0].token_ids)
    request = {"model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0,
               "ignore_eos": True}

    async def test(http, client):
        streamed = await http.post("/v1/completions", json={
            **request, "stream": True, "return_token_ids": True})
        whole = await http.post("/v1/completions", json={**request, "return_token_ids": True})
        plain = await http.post("/v1/completions", json=request)
        return streamed, whole, plain

    streamed, whole, plain = with_server(tiny_llama, test)
    chunks = [e for e in sse_events(streamed.text) if e != "[DONE]"]
    ids = [c["choices"][0]["token_ids"] for c in chunks]
    assert all(ids[:-1])  # every chunk before the finishing one brings a token
    assert sum(ids, []) == expected
    assert whole.json()["choices"][0]["token_ids"] == expected
    assert "token_ids" not in plain.json()["choices"][0]


@pytest.mark.slow  # a server of its own: ~27 s (make test's budget)
def test_sampled_logprobs_report_the_sampled_token_and_n3_stream_finishes_once():
    # the real SmolLM2: at temperature 1 it often samples a top-5 token that is not the argmax
    # (a tiny random model is near uniform: its sampled token is almost never in the top-5)
    from transformers import AutoTokenizer

    from echo.models.default_model import ensure_default_model

    folder = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Tell me a story about a dragon."}]
    common = {"model": NAME, "temperature": 1, "seed": 3, "ignore_eos": True,
              "return_token_ids": True}

    async def test(http, client):
        chat = await http.post("/v1/chat/completions", json={
            **common, "messages": messages, "max_completion_tokens": 50, "logprobs": True,
            "top_logprobs": 5})
        completion = await http.post("/v1/completions", json={
            **common, "prompt": "Once upon a time, a dragon", "max_tokens": 50, "logprobs": 5})
        # choices end at different steps (at their first "."), so the finished ones ride
        # along in the request's outputs while the others go on
        streamed = await http.post("/v1/chat/completions", json={
            "model": NAME, "messages": messages, "max_completion_tokens": 40,
            "temperature": 1, "seed": 5, "n": 3, "stop": ["."], "stream": True})
        return chat, completion, streamed

    chat, completion, streamed = with_server(folder, test)
    assert chat.status_code == 200 and completion.status_code == 200, (chat.text,
                                                                        completion.text)
    # (token, logprob, top-5 as {token: logprob}) per generated token, per format
    choice = chat.json()["choices"][0]
    chat_rows = [(c["token"], c["logprob"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                 for c in choice["logprobs"]["content"]]
    formats = [(choice["token_ids"], chat_rows)]
    choice = completion.json()["choices"][0]
    lp = choice["logprobs"]
    formats.append((choice["token_ids"], list(zip(lp["tokens"], lp["token_logprobs"],
                                                   lp["top_logprobs"]))))
    for ids, rows in formats:
        assert len(ids) == len(rows) == 50
        below_rank_1 = 0
        for token_id, (token, logprob, top) in zip(ids, rows):
            assert token == tokenizer.decode([token_id])
            assert len(top) == 5 and logprob <= 0
            if token in top:
                assert logprob == top[token]
                below_rank_1 += token != max(top, key=top.get)
        assert below_rank_1 > 0  # the case the bug got wrong was exercised

    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]"
    choices = [c["choices"][0] for c in events[:-1]]
    finishes = {i: [c["finish_reason"] for c in choices
                    if c["index"] == i and c["finish_reason"] is not None] for i in range(3)}
    assert all(len(f) == 1 for f in finishes.values()), finishes
    # the finish chunk is each choice's last
    last = {c["index"]: c for c in choices}
    assert all(last[i]["finish_reason"] is not None for i in range(3))
    # the choices finished at different steps: the case the bug got wrong was exercised
    lengths = [sum(c["index"] == i for c in choices) for i in range(3)]
    assert len(set(lengths)) > 1, lengths
