"""Tool calls and reasoning through the real server (`python -m echo serve`, CPU) with the
official `openai` client, on a tiny random Qwen3 that speaks SmolLM2's vocabulary plus the
single tokens <think>, </think>, <tool_call> and </tool_call>, under chat templates written
here: a Qwen3-style one, and a DeepSeek-R1-style one whose prompt opens the reasoning.

The weights are random, so every output a test checks is forced: by a grammar (an EBNF literal;
the parsers read the text, whatever tokens spell it), or by a +100 logit bias on one token where
the grammar is gated off (inside the reasoning).
"""

import json
from dataclasses import dataclass

import httpx
import jsonschema
import openai
import pytest

from tests.entrypoints.test_serve_process import start_server

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
SCHEMA = {"type": "object",
          "properties": {"city": {"enum": ["Paris", "Rome"]},
                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
TRIP = '{"city": "Paris", "days": 3}'  # an object of SCHEMA, to steer to
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"enable_thinking": False}
EMPTY_THINKING = "<think>\n\n</think>\n\n"  # what the template adds with thinking off
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Qwen3's layout: the tools in a system block, an empty reasoning after the generation prompt
# when thinking is off
QWEN3_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools: {% for tool in tools %}{{ tool.function.name }};{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""
# DeepSeek-R1's: the prompt ends inside the reasoning
R1_TEMPLATE = """\
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


@dataclass(frozen=True)
class Model:
    folder: object  # Path
    tokenizer: object
    ids: dict  # tag -> its token id

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from echo.models.default_model import ensure_default_model

    folder = tmp_path_factory.mktemp("tiny_thinking_qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    assert tokenizer.add_tokens(list(TAGS)) == len(TAGS)  # plain (non-special) tokens
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # only --chat-template's counts
    ids = {tag: tokenizer.convert_tokens_to_ids(tag) for tag in TAGS}
    assert len(set(ids.values())) == len(TAGS) and tokenizer.unk_token_id not in ids.values()
    assert all(tokenizer.encode(tag, add_special_tokens=False) == [ids[tag]] for tag in TAGS)
    eos = tokenizer.eos_token_id
    config = Qwen3Config(vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
                         eos_token_id=eos, pad_token_id=eos, rope_theta=10000.0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    (folder / "qwen3.jinja").write_text(QWEN3_TEMPLATE)
    (folder / "r1.jinja").write_text(R1_TEMPLATE)
    return Model(folder, tokenizer, ids)


def serve(model: Model, template: str, *flags: str):
    """A server on the model with one of its folder's templates; yields an openai client and
    ends the process afterwards."""
    server = start_server(str(model.folder), "--chat-template", str(model.folder / template),
                          "--num-gpu-blocks-override", "128", *flags)
    _, base = next(server)
    try:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    finally:
        server.close()


def grammar(text: str) -> str:
    """An EBNF grammar whose only sentence is text."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'root ::= "{escaped}"'


def steering(model: Model, text: str) -> dict[str, int]:
    """A logit bias that steers the model to the tokenizer's own tokens of text where a
    grammar allows text (fewer steps, and a schema's output ends; the grammar alone decides
    what is valid)."""
    return {str(t): 30 for t in model.tokenizer.encode(text, add_special_tokens=False)}


def forcing(model: Model, text: str) -> dict:
    """chat() arguments that force the output to be text, for a prompt whose reasoning is
    closed (the grammar applies from the first token)."""
    return {"extra_body": {"structured_outputs": {"grammar": grammar(text)}},
            "logit_bias": steering(model, text)}


def chat(client, messages=ASK, *, max_tokens: int = 60, extra_body: dict | None = None,
         template_kwargs: dict | None = None, **kwargs):
    """A greedy chat completion (chunks with stream=True)."""
    body = dict(extra_body or {})
    if template_kwargs is not None:
        body["chat_template_kwargs"] = template_kwargs
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                          max_tokens=max_tokens, extra_body=body, **kwargs)


def reasoning_of(message) -> str | None:
    """message.reasoning_content (or a delta's), checked equal to its .reasoning."""
    reasoning = getattr(message, "reasoning_content", None)
    assert getattr(message, "reasoning", None) == reasoning
    return reasoning


def assemble(chunks) -> dict:
    """A streamed choice put together: its reasoning, content, calls and last finish reason;
    each call's id, type and name come once, on its first delta, then argument fragments."""
    reasoning, content, finishes, calls = "", "", [], {}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += reasoning_of(delta) or ""
        content += delta.content or ""
        finishes.append(choice.finish_reason)
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id.startswith("call_") and call.type == "function", call
                calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None, call
            calls[call.index]["arguments"] += call.function.arguments or ""
    assert set(finishes[:-1]) == {None}, finishes
    return {"reasoning": reasoning, "content": content, "finish_reason": finishes[-1],
            "calls": [calls[i] for i in sorted(calls)]}


def streamed(client, **kwargs) -> dict:
    return assemble(chat(client, stream=True, **kwargs))


@pytest.fixture(scope="class")
def hermes(model):
    yield from serve(model, "qwen3.jinja", "--reasoning-parser", "qwen3",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


class TestQwen3WithHermes:
    """The Qwen3 template, --reasoning-parser qwen3, hermes tool calls."""

    def test_reasoning_whole_and_streamed_with_thinking_off_per_request(self, hermes, model):
        request = {**forcing(model, '<think>plan</think>{"a": 1}'),
                   "template_kwargs": NO_THINKING}
        answer = chat(hermes, **request)
        choice = answer.choices[0]
        assert reasoning_of(choice.message) == "plan"
        assert choice.message.content == '{"a": 1}'
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert streamed(hermes, **request) == {"reasoning": "plan", "content": '{"a": 1}',
                                               "finish_reason": "stop", "calls": []}
        # the kwarg reached the template: the empty reasoning is in the prompt
        thinking = chat(hermes, max_tokens=1)
        assert answer.usage.prompt_tokens - thinking.usage.prompt_tokens == \
            model.count(EMPTY_THINKING) == 4

    def test_closed_reasoning_in_the_prompt_lets_the_grammar_refuse_end_think(
            self, hermes, model):
        """The control of TestDeepSeekR1's gate test: with the prompt's reasoning closed, the
        schema applies from the first token, and a +100 bias cannot make a </think>."""
        end = model.ids["</think>"]
        choice = chat(hermes, response_format=RESPONSE_FORMAT, template_kwargs=NO_THINKING,
                      logit_bias={**steering(model, TRIP), str(end): 100},
                      extra_body={"return_token_ids": True}).choices[0]
        assert choice.finish_reason == "stop" and end not in choice.token_ids
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert reasoning_of(choice.message) is None

    def test_a_closed_pair_in_the_prompt_applies_the_grammar_from_the_first_token(
            self, hermes, model):
        answer = chat(hermes, max_tokens=8, template_kwargs=NO_THINKING,
                      logit_bias={str(model.ids["<think>"]): 100},
                      extra_body={"structured_outputs": {"grammar": 'root ::= "ok"'}})
        assert answer.choices[0].message.content == "ok"

    def test_tool_call_whole_and_streamed(self, hermes, model):
        request = {**forcing(model, HERMES_CALL), "tools": [WEATHER, TIME],
                   "tool_choice": "auto", "template_kwargs": NO_THINKING}
        choice = chat(hermes, **request).choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and reasoning_of(choice.message) is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        stream = streamed(hermes, **request)
        assert [(c["name"], json.loads(c["arguments"])) for c in stream["calls"]] == \
            [("get_weather", {"city": "Paris"})]
        assert stream["content"] == stream["reasoning"] == ""
        assert stream["finish_reason"] == "tool_calls"

    def test_calls_come_from_the_content_not_the_reasoning(self, hermes, model):
        request = {"tools": [WEATHER], "template_kwargs": NO_THINKING, "max_tokens": 80}
        choice = chat(hermes, **forcing(model, f"<think>x</think>{HERMES_CALL}"),
                      **request).choices[0]
        assert reasoning_of(choice.message) == "x"
        assert choice.message.content is None and choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == \
            ("get_weather", {"city": "Paris"})
        # a call inside the reasoning is none
        inner = HERMES_CALL.replace("Paris", "Rome")
        forced = forcing(model, f"<think>{inner}</think>No call.")
        choice = chat(hermes, **forced, **request).choices[0]
        assert reasoning_of(choice.message) == inner
        assert choice.message.content == "No call."
        assert choice.message.tool_calls is None and choice.finish_reason == "stop"
        assert streamed(hermes, **forced, **request) == {
            "reasoning": inner, "content": "No call.", "finish_reason": "stop", "calls": []}

    def test_tools_reach_the_chat_template(self, hermes, model):
        without = chat(hermes, max_tokens=1).usage.prompt_tokens
        with_tools = chat(hermes, max_tokens=1, tools=[WEATHER, TIME]).usage.prompt_tokens
        block = "<|im_start|>system\nTools: get_weather;get_time;<|im_end|>\n"
        assert with_tools - without == model.count(block)

    def test_tool_choice_naming_a_function_not_among_the_tools_is_a_400(self, hermes):
        with pytest.raises(openai.BadRequestError) as e:
            chat(hermes, max_tokens=4, tools=[WEATHER],
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"
        assert "get_time" in e.value.body["message"]


@pytest.fixture(scope="class")
def llama3(model):
    yield from serve(model, "qwen3.jinja", "--reasoning-parser", "qwen3",
                     "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                     "--default-chat-template-kwargs", json.dumps(NO_THINKING))


class TestLlama3JsonWithThinkingOffByDefault:
    """llama3_json tool calls; thinking off by --default-chat-template-kwargs."""

    def test_tool_call_whole_and_streamed(self, llama3, model):
        request = {**forcing(model, '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
                   "tools": [WEATHER]}
        choice = chat(llama3, **request).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        stream = streamed(llama3, **request)
        assert [(c["name"], json.loads(c["arguments"])) for c in stream["calls"]] == \
            [("get_weather", {"city": "Paris"})]
        assert stream["finish_reason"] == "tool_calls" and stream["content"] == ""

    def test_the_default_turns_thinking_off_and_a_request_overrides_it(self, llama3, model):
        request = forcing(model, "<think>plan</think>Paris.")
        answer = chat(llama3, **request)
        message = answer.choices[0].message
        assert (reasoning_of(message), message.content) == ("plan", "Paris.")
        assert streamed(llama3, **request) == {"reasoning": "plan", "content": "Paris.",
                                               "finish_reason": "stop", "calls": []}
        on = chat(llama3, max_tokens=1, template_kwargs={"enable_thinking": True})
        assert answer.usage.prompt_tokens - on.usage.prompt_tokens == \
            model.count(EMPTY_THINKING)


    def test_tokenize_renders_the_prompt_chat_completions_does(self, llama3):
        """/tokenize with messages applies the server's template defaults and the tools."""
        base = str(llama3.base_url).rstrip("/").removesuffix("/v1")
        for tools in ({}, {"tools": [WEATHER]}):
            count = httpx.post(f"{base}/tokenize", json={"messages": ASK, **tools}).json()
            answer = chat(llama3, max_tokens=1, **tools,
                          **({"tool_choice": "none"} if tools else {}))
            assert count["count"] == answer.usage.prompt_tokens


@pytest.fixture(scope="class")
def r1(model):
    yield from serve(model, "r1.jinja", "--reasoning-parser", "deepseek_r1")


class TestDeepSeekR1:
    """The R1 template (the prompt opens the reasoning), --reasoning-parser deepseek_r1, no
    --enable-auto-tool-choice."""

    def test_the_grammar_waits_for_the_end_of_the_reasoning(self, r1, model):
        end = model.ids["</think>"]
        choice = chat(r1, response_format=RESPONSE_FORMAT,
                      logit_bias={**steering(model, TRIP), str(end): 100},
                      extra_body={"return_token_ids": True}).choices[0]
        # </think> first, which only the open reasoning allows (the schema refuses it: see
        # the control in TestQwen3WithHermes), then JSON of the schema and EOS
        assert choice.token_ids[0] == end and end not in choice.token_ids[1:]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert not reasoning_of(choice.message)

    def test_a_named_tool_choice_needs_no_flag_and_waits_for_the_reasoning(self, r1, model):
        choice = chat(r1, tools=[WEATHER, TIME], tool_choice=NAMED_WEATHER,
                      logit_bias={**steering(model, '{"city": "Paris"}'),
                                  str(model.ids["</think>"]): 100}).choices[0]
        assert choice.finish_reason == "stop"  # a named choice stops, as in OpenAI's API
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments),
                            WEATHER["function"]["parameters"])
        assert choice.message.content is None and not reasoning_of(choice.message)

    def test_auto_tool_choice_without_the_flag_is_a_400(self, r1):
        with pytest.raises(openai.BadRequestError) as e:
            chat(r1, max_tokens=4, tools=[WEATHER], tool_choice="auto")
        assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in e.value.body["message"]
