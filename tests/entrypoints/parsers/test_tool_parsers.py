"""Tool parsers on scripted model outputs, against hand-written calls and content; every
streamed case is fed whole, a character at a time and in random chunks, and must add up to
what parse() returns."""

import json
import random

import jsonschema
import pytest

from echo.entrypoints.parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolCallParser,
    ParsedMessage,
    RequiredToolCallsParser,
    ToolCall,
    ToolCallDelta,
    get_tool_parser,
    tool_choice_json_schema,
)
from tests.entrypoints.parsers.test_json_stream import chunkings


def run_stream(parser, chunks) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments text)]) of a stream fed chunks, checking the deltas'
    shape on the way: calls numbered from 0 in order, the name on a call's first delta only."""
    stream = parser.stream()
    content, calls = [], {}
    for text, deltas in [*map(stream.feed, chunks), stream.finish()]:
        content.append(text)
        for delta in deltas:
            if delta.index in calls:
                assert delta.name is None
                calls[delta.index][1].append(delta.arguments)
            else:
                assert delta.index == len(calls)
                assert delta.name is not None
                calls[delta.index] = (delta.name, [delta.arguments])
    return "".join(content), [(name, "".join(pieces)) for name, pieces in calls.values()]


def assert_stream_matches_parse(parser, text: str, **cuts) -> ParsedMessage:
    parsed = parser.parse(text)
    for chunks in chunkings(text, **cuts):
        content, calls = run_stream(parser, chunks)
        assert content == (parsed.content or ""), chunks
        assert [name for name, _ in calls] == [call.name for call in parsed.tool_calls]
        assert ([json.loads(arguments) for _, arguments in calls]
                == [json.loads(call.arguments) for call in parsed.tool_calls])
    return parsed


QWEN3_TWO_CALLS = (
    "I'll check both cities.\n\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n'
    "</tool_call>")


def test_hermes_two_calls_after_content():
    parsed = assert_stream_matches_parse(HermesToolParser(), QWEN3_TWO_CALLS)
    assert parsed == ParsedMessage("I'll check both cities.", [
        ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ToolCall("get_time", '{"tz": "Europe/Paris"}')])


def test_hermes_stream_merges_a_chunk_into_one_delta_per_call():
    stream = HermesToolParser().stream()
    assert stream.feed(QWEN3_TWO_CALLS) == ("I'll check both cities.", [
        ToolCallDelta(0, "get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ToolCallDelta(1, "get_time", '{"tz": "Europe/Paris"}')])
    assert stream.finish() == ("", [])


def test_hermes_nested_arguments_with_escapes():
    text = ('<tool_call>\n{"name": "run_code", "arguments": {"code": "print(\\"}{\\")\\n", '
            '"opts": {"langs": ["py", {"v": "3.\\u00e9"}], "slash": "\\\\"}}}\n</tool_call>')
    parsed = assert_stream_matches_parse(HermesToolParser(), text)
    assert parsed == ParsedMessage(None, [ToolCall(
        "run_code",
        '{"code": "print(\\"}{\\")\\n", "opts": {"langs": ["py", {"v": "3.é"}], '
        '"slash": "\\\\"}}')])


def test_hermes_content_between_calls_and_whitespace_only_content():
    text = ('First.<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
            '<tool_call>{"name": "b", "arguments": {"k": "v"}}</tool_call> end.')
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        "First. then  end.", [ToolCall("a", "{}"), ToolCall("b", '{"k": "v"}')])
    text = '\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n\n'
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        None, [ToolCall("a", '{"x": 1}')])


def test_hermes_tags_inside_strings_are_text():
    text = ('<tool_call>{"name": "echo", "arguments": {"text": "</tool_call> <tool_call>"}}'
            "</tool_call>")
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        None, [ToolCall("echo", '{"text": "</tool_call> <tool_call>"}')])


def test_hermes_last_call_without_end_tag_and_call_without_arguments():
    text = 'Calling.\n<tool_call>\n{"name": "a", "arguments": {"x": [1, 2]}}\n'
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        "Calling.", [ToolCall("a", '{"x": [1, 2]}')])
    text = '<tool_call>{"name": "ping"}</tool_call>'
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        None, [ToolCall("ping", "{}")])


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{name: "f"}\n</tool_call>\nDone.',
    "<tool_call>[1, 2]</tool_call> ok",
    'Hmm <tool_call>\n{"arguments": {"x": 1}, "na',
    'a <tool_call> oops <tool_call>{"name": "b", "arguments": {}}</tool_call> z',
    '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
])
def test_hermes_block_that_is_no_call_is_content(text):
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        text.strip(), [])


def test_hermes_call_numbering_skips_blocks_that_are_no_call():
    text = ('<tool_call>{"arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert assert_stream_matches_parse(HermesToolParser(), text) == ParsedMessage(
        '<tool_call>{"arguments": {"x": 1}}</tool_call>', [ToolCall("b", "{}")])


def test_hermes_json_broken_after_the_name():
    """parse() leaves the block as content; a stream has sent the call by then, so it keeps
    it, with the model's text, and drops the rest of the block."""
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {bad}}\n</tool_call>\nDone.'
    assert HermesToolParser().parse(text) == ParsedMessage(text, [])
    for chunks in chunkings(text):
        assert run_stream(HermesToolParser(), chunks) == ("Sure.\n\nDone.", [("f", "{bad}")])
    text = 'A<tool_call>{"name": "f", "arguments": {}} junk</tool_call>B'
    assert HermesToolParser().parse(text) == ParsedMessage(text, [])
    for chunks in chunkings(text):
        assert run_stream(HermesToolParser(), chunks) == ("AB", [("f", "{}")])
    text = '<tool_call>{"name": "f", "arguments": {"x": '
    assert HermesToolParser().parse(text) == ParsedMessage(text.strip(), [])
    for chunks in chunkings(text):
        assert run_stream(HermesToolParser(), chunks) == ("", [("f", '{"x": ')])


def test_hermes_stream_holds_back_a_partial_tag():
    stream = HermesToolParser().stream()
    assert stream.feed("Hi<tool_") == ("Hi", [])
    assert stream.feed('call>\n{"name": "f", ') == ("", [ToolCallDelta(0, name="f")])
    assert stream.feed('"arguments": {"a"') == ("", [ToolCallDelta(0, arguments='{"a"')])
    assert stream.feed(": 1}}\n</tool") == ("", [ToolCallDelta(0, arguments=": 1}")])
    assert stream.feed("_call>\nBye") == ("\nBye", [])
    assert stream.finish() == ("", [])

    stream = HermesToolParser().stream()
    assert stream.feed("a <tool") == ("a", [])
    assert stream.feed("box> b") == (" <toolbox> b", [])
    assert stream.feed(" <") == ("", [])
    assert stream.finish() == (" <", [])


def _random_hermes_output(rng: random.Random) -> str:
    """Content, partial and stray tags, and well-formed calls in random order: outputs on
    which a stream and parse() must agree."""
    calls = [
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '{"arguments": {"q": "a \\"}\\" {", "n": [1, {"x": null}]}, "name": "search"}',
        '{"name": "uni\\u00e9", "arguments": {"s": "\\ud83d\\ude00", "t": "</tool_call>"}}',
        '{"name": "ping"}',
        '{"type": "function", "name": "go", "arguments": {"p": "C:\\\\"}}',
    ]
    content = ["Hello", " ", "\n", "<", "<tool_", "tool_call>", "</tool_call>", "{", "}", "é",
                "<tool_call>", "<tool_call>\n"]
    parts = []
    for _ in range(rng.randint(0, 8)):
        if rng.random() < 0.4:
            space = rng.choice(["", "\n", " "])
            parts.append(f"<tool_call>{space}{rng.choice(calls)}{space}</tool_call>")
        else:
            parts.append(rng.choice(content))
    if rng.random() < 0.2:
        parts.append(f"<tool_call>\n{rng.choice(calls)}\n")  # the end tag never came
    return "".join(parts)


def test_hermes_stream_matches_parse_on_random_outputs():
    rng = random.Random(1234)
    with_calls = 0
    for _ in range(150):
        text = _random_hermes_output(rng)
        with_calls += bool(assert_stream_matches_parse(HermesToolParser(), text,
                                                       seeds=range(2)).tool_calls)
    assert with_calls > 50


LLAMA3_CALLS = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    (' \n{"name": "search", "arguments": {"q": "a;b \\"c\\""}}',
     [ToolCall("search", '{"q": "a;b \\"c\\""}')]),
    ('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, {"y": "}"}]}}',
     [ToolCall("a", "{}"), ToolCall("b", '{"x": [1, {"y": "}"}]}')]),
    ('<|python_tag|> {"type": "function", "name": "a", "parameters": {"u": "\\u00e9"}} ;\n',
     [ToolCall("a", '{"u": "é"}')]),
    ('{"parameters": {"k": 1}, "name": "late"};{"name": "bare"}',
     [ToolCall("late", '{"k": 1}'), ToolCall("bare", "{}")]),
]


@pytest.mark.parametrize(("text", "calls"), LLAMA3_CALLS)
def test_llama3_json_calls(text, calls):
    assert assert_stream_matches_parse(Llama3JsonToolParser(), text) == ParsedMessage(None,
                                                                                      calls)


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    'I think {"name": "f"} is JSON.',
    '<|python_tag|>print("hi")',
    "<|python_tag|>",
    "<|python",
    "{not json}",
    '{"nam": 1}',
    "   ",
    "",
])
def test_llama3_json_plain_content(text):
    assert assert_stream_matches_parse(Llama3JsonToolParser(), text) == ParsedMessage(
        text.strip() or None, [])


def test_llama3_json_text_after_a_sent_call():
    """parse() makes the whole output content; a stream has sent the call and drops the rest."""
    text = '{"name": "f", "parameters": {}} and more'
    assert Llama3JsonToolParser().parse(text) == ParsedMessage(text, [])
    for chunks in chunkings(text):
        assert run_stream(Llama3JsonToolParser(), chunks) == ("", [("f", "{}")])
    text = '{"name": "f", "parameters": {"x'
    assert Llama3JsonToolParser().parse(text) == ParsedMessage(text, [])
    for chunks in chunkings(text):
        assert run_stream(Llama3JsonToolParser(), chunks) == ("", [("f", '{"x')])


def test_llama3_json_stream_matches_parse_on_random_outputs():
    calls = ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
             '{"name": "search", "arguments": {"q": "a;b \\"c\\""}}',
             '{"parameters": {"x": [1, {"y": "}"}]}, "name": "b"}',
             '{"name": "bare"}']
    rng = random.Random(99)
    with_calls = 0
    for _ in range(60):
        text = rng.choice(calls)
        for _ in range(rng.randint(0, 2)):
            text += rng.choice([";", " ; ", ";\n"]) + rng.choice(calls)
        text += rng.choice(["", ";", " ;\n"])
        # a start that makes it content, or one that does not
        text = rng.choice(["", " ", "<|python_tag|>", "\n<|python_tag|> ", "Sure: ", "{x",
                           "<|py"]) + text
        with_calls += bool(assert_stream_matches_parse(Llama3JsonToolParser(), text,
                                                       seeds=range(2)).tool_calls)
    assert 20 < with_calls < 50


def test_llama3_json_stream_holds_back_the_python_tag():
    stream = Llama3JsonToolParser().stream()
    assert stream.feed(" <|python") == ("", [])
    assert stream.feed("_tag|>\n") == ("", [])
    assert stream.feed('{"name": "f"') == ("", [ToolCallDelta(0, name="f")])
    assert stream.feed(', "parameters": {"a": 1}}') == (
        "", [ToolCallDelta(0, arguments='{"a": 1}')])
    assert stream.finish() == ("", [])

    stream = Llama3JsonToolParser().stream()
    assert stream.feed("<|py") == ("", [])
    assert stream.feed("thon!") == ("<|python!", [])


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {"tz": "UTC"}}]')


def test_required_array():
    parsed = assert_stream_matches_parse(RequiredToolCallsParser(), REQUIRED)
    assert parsed == ParsedMessage(None, [ToolCall("get_weather", '{"city": "Paris"}'),
                                          ToolCall("get_time", '{"tz": "UTC"}')])
    text = '[\n  {"parameters": {"q": "[x]", "n": {"m": []}}, "name": "search"}\n]\n'
    assert assert_stream_matches_parse(RequiredToolCallsParser(), text) == ParsedMessage(
        None, [ToolCall("search", '{"q": "[x]", "n": {"m": []}}')])


def test_required_array_cut_off_keeps_finished_calls():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y"'
    assert RequiredToolCallsParser().parse(text) == ParsedMessage(None, [ToolCall("a",
                                                                                  '{"x": 1}')])
    for chunks in chunkings(text):
        assert run_stream(RequiredToolCallsParser(), chunks) == (
            "", [("a", '{"x": 1}'), ("b", '{"y"')])


def test_named_tool_call():
    parser = NamedToolCallParser("get_weather")
    text = '  {"city": "Paris", "when": {"day": "today"}}\n'
    assert parser.parse(text) == ParsedMessage(None, [ToolCall(
        "get_weather", '{"city": "Paris", "when": {"day": "today"}}')])
    for chunks in chunkings(text):
        assert run_stream(parser, chunks) == (
            "", [("get_weather", '{"city": "Paris", "when": {"day": "today"}}')])
    stream = parser.stream()
    assert stream.feed('{"a"') == ("", [ToolCallDelta(0, "get_weather", '{"a"')])
    assert stream.feed(": 1} \n") == ("", [ToolCallDelta(0, arguments=": 1}")])
    assert stream.finish() == ("", [])
    stream = parser.stream()
    assert stream.finish() == ("", [ToolCallDelta(0, name="get_weather")])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_json_schema():
    schema = tool_choice_json_schema([WEATHER, TIME])
    assert schema == {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": {"type": "object",
                                       "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}},
         "required": ["name", "parameters"], "additionalProperties": False},
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object"}},
         "required": ["name", "parameters"], "additionalProperties": False},
    ]}}
    jsonschema.validate(json.loads(REQUIRED), schema)
    for wrong in ([], [{"name": "get_weather", "parameters": {}}],
                  [{"name": "nope", "parameters": {}}],
                  [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_registry():
    assert TOOL_PARSERS == {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    with pytest.raises(ValueError, match=r"--tool-call-parser.*'mistral'.*hermes, llama3_json"):
        get_tool_parser("mistral")
