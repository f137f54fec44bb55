"""vLLM's API surface beyond OpenAI's: /tokenize, /detokenize, /ping, continuous usage stats,
chat template arguments (chat_template_kwargs, continue_final_message, tool messages intact),
and keep-alive comments on streams. The reference is the model folder's own tokenizer."""

import asyncio

import httpx
import pytest
from transformers import AutoTokenizer

from echo import LLM, SamplingParams
from echo.engine.async_client import AsyncClient
from echo.entrypoints.api_server import ServerOptions, create_app
from tests.entrypoints.test_api_server import ENGINE_ARGS, NAME, sse_events

# renders every field the server must pass through, and one template variable
TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}call:{{ c.function.name }}"
    "{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }}</{{ m.role }}>"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ flavour }}")


def with_app(folder, test, options=None, chat_template=TEMPLATE):
    async def main():
        async with AsyncClient(str(folder), chat_template=chat_template, **ENGINE_ARGS) as client:
            app = create_app(client, [NAME], None, 1 << 20, options or ServerOptions())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://test", timeout=60) as http:
                return await test(http)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    return AutoTokenizer.from_pretrained(str(tiny_chat_model))


def test_tokenize_detokenize_and_ping(tiny_chat_model, tokenizer):
    prompt = "The quick brown fox"
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "one"},
                                             {"type": "text", "text": "two"}]}]

    async def test(http):
        plain = (await http.post("/tokenize", json={"model": NAME, "prompt": prompt,
                                                    "return_token_strs": True})).json()
        chat = (await http.post("/tokenize", json={
            "messages": messages, "chat_template_kwargs": {"flavour": "mint"}})).json()
        text = (await http.post("/detokenize", json={"tokens": plain["tokens"]})).json()
        bad = [await http.post("/detokenize", json={"tokens": tokens})
               for tokens in ([10**9], [1] * 257)]  # out of the vocabulary; past max_model_len
        empty = (await http.post("/detokenize", json={"tokens": []})).json()
        pings = [(await http.get("/ping")).status_code, (await http.post("/ping")).status_code]
        return plain, chat, text, bad, empty, pings

    plain, chat, text, bad, empty, pings = with_app(tiny_chat_model, test)
    want = tokenizer.encode(prompt)
    assert plain == {"count": len(want), "max_model_len": 256, "tokens": want,
                     "token_strs": tokenizer.convert_ids_to_tokens(want)}
    # text parts joined by a newline, as vLLM joins them; the template variable reached it
    rendered = "<system>Be brief.</system><user>one\ntwo</user><assistant>mint"
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert text == {"prompt": tokenizer.decode(want)}
    # the request's own field is named (the ids are not a prompt here)
    assert [(r.status_code, r.json()["error"]["param"]) for r in bad] == [(400, "tokens")] * 2
    assert empty == {"prompt": ""}
    assert pings == [200, 200]


def test_tool_messages_and_continue_final_message_reach_the_template(tiny_chat_model, tokenizer):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is"},
    ]

    async def test(http):
        r = await http.post("/tokenize", json={"messages": messages,
                                               "add_generation_prompt": False,
                                               "continue_final_message": True})
        both = await http.post("/v1/chat/completions", json={
            "messages": messages, "continue_final_message": True, "max_tokens": 2})
        reserved = await http.post("/v1/chat/completions", json={
            "messages": messages[:1], "chat_template_kwargs": {"tokenize": True}})
        return r.json(), both, reserved

    rendered, both, reserved = with_app(tiny_chat_model, test)
    # the final assistant message stays open: nothing after its content
    want = ("<user>weather?</user><assistant>call:get_weather</assistant>"
            "<tool>[c1]sunny</tool><assistant>It is")
    assert rendered["tokens"] == tokenizer.encode(want, add_special_tokens=False)
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_echo_starts_the_reply_with_the_assistants_last_message(tiny_chat_model):
    """vLLM's chat echo: a reply that continues the assistant's last message starts with it,
    streamed or not; with a user's last message there is nothing to repeat."""
    open_reply = [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "It is"}]
    base = {"messages": open_reply, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}

    async def test(http):
        plain = await http.post("/v1/chat/completions", json=base)
        echoed = await http.post("/v1/chat/completions", json={**base, "echo": True})
        streamed = await http.post("/v1/chat/completions",
                                   json={**base, "echo": True, "stream": True})
        user_last = await http.post("/v1/chat/completions", json={
            "messages": open_reply[:1], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "echo": True})
        user_plain = await http.post("/v1/chat/completions", json={
            "messages": open_reply[:1], "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        return plain, echoed, streamed, user_last, user_plain

    plain, echoed, streamed, user_last, user_plain = with_app(tiny_chat_model, test)
    content = plain.json()["choices"][0]["message"]["content"]
    assert echoed.json()["choices"][0]["message"]["content"] == "It is" + content
    deltas = [e["choices"][0]["delta"].get("content") or "" for e in sse_events(streamed.text)
              if e != "[DONE]" and e["choices"]]
    assert "".join(deltas) == "It is" + content
    assert (user_last.json()["choices"][0]["message"]["content"]
            == user_plain.json()["choices"][0]["message"]["content"])


def test_llm_chat_takes_template_arguments(tiny_chat_model, tokenizer):
    llm = LLM(str(tiny_chat_model), **ENGINE_ARGS)
    llm.input_processor.chat_template = TEMPLATE
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                   use_tqdm=False, chat_template_kwargs={"flavour": "lime"})
    assert out[0].prompt_token_ids == tokenizer.encode("<user>hi</user><assistant>lime",
                                                       add_special_tokens=False)


def test_continuous_usage_stats_and_keep_alive_comments(tiny_chat_model):
    async def test(http):
        r = await http.post("/v1/completions", json={
            "prompt": "Once", "max_tokens": 150, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        return r.text

    text = with_app(tiny_chat_model, test, ServerOptions(sse_ping_s=0.05))
    chunks = [e for e in sse_events(text) if e != "[DONE]"]
    completion = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert completion == sorted(completion) and completion[-1] == 150
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"]
               for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 150
    # comments (": ping ...") keep a proxy from closing a stream that is slow to produce
    assert any(line.startswith(":") for line in text.splitlines())
