"""Structured outputs and forced tool calls through the real server on SmolLM2 (CPU), with the
official `openai` client: every output is checked by an independent parser (json + jsonschema,
re, a small arithmetic parser)."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.entrypoints.test_serve_process import start_server

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 50_000_000},
        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24},
                      "maxItems": 3},
    },
    "required": ["city", "population", "continent", "landmarks"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Tell me about Paris as JSON."}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# arithmetic expressions, bounded so that a sampled one ends
ARITHMETIC = ('root ::= expr\nexpr ::= term (("+" | "-") term){0,2}\n'
              'term ::= factor (("*" | "/") factor){0,2}\n'
              'factor ::= [1-9] [0-9]? | "(" expr ")"')


@pytest.fixture(scope="module")
def client():
    from echo.models.default_model import ensure_default_model

    ensure_default_model()
    server = start_server("default", "--dtype", "float32", "--max-num-seqs", "16")
    _, base = next(server)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    server.close()


def parallel(calls):
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda call: call(), calls))


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, **kwargs)


@pytest.mark.slow  # ten sampled replies through the server: ~11 s (make test's budget)
def test_json_schema_validates_at_temperature_one_over_ten_seeds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA,
                                                   "strict": True}}
    answers = parallel([lambda s=seed: chat(client, ASK, temperature=1.0, seed=s,
                                            max_tokens=150, response_format=fmt)
                        for seed in range(10)])
    objects = []
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        objects.append(json.loads(choice.message.content))
        jsonschema.validate(objects[-1], SCHEMA)
    assert len({json.dumps(o) for o in objects}) > 3


def test_json_object_regex_choice_and_grammar(client):
    flat = [{"role": "user", "content": 'Reply with a flat JSON object with the keys "city" '
                                         'and "country" for Paris.'}]
    whole = chat(client, flat, temperature=0, max_tokens=120,
                 response_format={"type": "json_object"})
    assert whole.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(whole.choices[0].message.content), dict)
    phone = r"\+33 [1-9]( \d{2}){4}"
    choices = ["Paris", "Lyon", "Marseille"]
    for seed in range(3):
        text = client.completions.create(
            model="tiny", prompt="Call us at", max_tokens=30, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"regex": phone}}).choices[0].text
        assert re.fullmatch(phone, text), text
        answer = chat(client, WEATHER_ASK, max_tokens=10, temperature=1.0, seed=seed,
                      extra_body={"structured_outputs": {"choice": choices}})
        assert answer.choices[0].message.content in choices
        expression = client.completions.create(
            model="tiny", prompt="2 + 2 =", max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"grammar": ARITHMETIC}}).choices[0].text
        assert _parses_as_arithmetic(expression), expression


def test_vllm_guided_fields_behave_the_same(client):
    regex = r"[A-Z][a-z]{2,8}"
    same = [({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}),
            ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}),
            ({"guided_choice": ["yes", "no"]}, {"structured_outputs": {"choice": ["yes", "no"]}}),
            ({"guided_grammar": ARITHMETIC}, {"structured_outputs": {"grammar": ARITHMETIC}})]
    texts = [[chat(client, ASK, max_tokens=150, temperature=1.0, seed=3,
                   extra_body=body).choices[0].message.content for body in pair]
             for pair in same]
    assert all(old == new for old, new in texts)
    jsonschema.validate(json.loads(texts[0][0]), SCHEMA)
    assert re.fullmatch(regex, texts[1][0]) and texts[2][0] in ("yes", "no")
    assert _parses_as_arithmetic(texts[3][0])


@pytest.mark.slow  # six tool-call replies through the server: ~10 s a case (make test's budget)
@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_choice_give_valid_arguments(client, stream):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        for tool_choice in (named, "required"):
            calls, finish = _tool_calls(client, tool_choice, seed, stream)
            assert calls, (tool_choice, seed)
            if tool_choice is named:
                assert [name for name, _ in calls] == ["get_weather"] and finish == "stop"
            else:
                assert finish == "tool_calls"
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])


def test_bad_constraints_are_400s_naming_the_field(client):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objec"}}}}, "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nowhere"}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a" * 100_001}}}, "structured_outputs"),
        ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "guided_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                              "function": {"name": "get_time"}}}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
         "tools[0]"),
    ]
    for kwargs, field in bad:
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, ASK, max_tokens=4, **kwargs)
        assert e.value.body["param"].startswith(field), (kwargs, e.value.body)
    assert chat(client, ASK, max_tokens=4).choices[0].message.content  # still serving


def _tool_calls(client, tool_choice, seed: int, stream: bool):
    kwargs = dict(tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120,
                  temperature=1.0, seed=seed)
    if not stream:
        choice = chat(client, WEATHER_ASK, **kwargs).choices[0]
        return ([(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
                choice.finish_reason)
    calls: dict[int, list] = {}
    finish = None
    for chunk in chat(client, WEATHER_ASK, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.function.name  # the first delta names the call
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(calls[i]) for i in sorted(calls)], finish


def _parses_as_arithmetic(text: str) -> bool:
    """A recursive-descent check of expr := term (+|- term)*, term := factor (*|/ factor)*,
    factor := number | ( expr )."""
    tokens = re.findall(r"\d+|[-+*/()]|\S", text)
    pos = 0

    def factor() -> bool:
        nonlocal pos
        if pos < len(tokens) and tokens[pos].isdigit():
            pos += 1
            return True
        if pos < len(tokens) and tokens[pos] == "(":
            pos += 1
            if expr() and pos < len(tokens) and tokens[pos] == ")":
                pos += 1
                return True
        return False

    def chain(operand, operators) -> bool:
        nonlocal pos
        if not operand():
            return False
        while pos < len(tokens) and tokens[pos] in operators:
            pos += 1
            if not operand():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(tokens) and "".join(tokens) == text
