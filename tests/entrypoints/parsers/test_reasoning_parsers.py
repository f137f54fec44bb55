"""Reasoning parsers on scripted thinking-model outputs, against hand-written splits; streamed
whole, a character at a time and in random chunks, the deltas must add up to split()."""

import random

import pytest

from echo.entrypoints.parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    get_reasoning_parser,
)
from tests.entrypoints.parsers.test_json_stream import chunkings


def run_stream(parser, chunks) -> tuple[str, str]:
    stream = parser.stream()
    reasoning, content = [], []
    for thought, said in [*map(stream.feed, chunks), stream.finish()]:
        reasoning.append(thought)
        content.append(said)
    return "".join(reasoning), "".join(content)


def assert_stream_matches_split(parser, text: str, **cuts) -> tuple[str | None, str | None]:
    reasoning, content = parser.split(text)
    for chunks in chunkings(text, **cuts):
        assert run_stream(parser, chunks) == (reasoning or "", content or ""), chunks
    return reasoning, content


QWEN3 = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.",
     ("\nThe user wants 2+2.\n", "The answer is 4.")),
    ("<think>\nStill thinking about <b>tags</b> and </thinking", (
        "\nStill thinking about <b>tags</b> and </thinking", None)),  # cut off by max_tokens
    ("Hello! How can I help?", (None, "Hello! How can I help?")),  # thinking off
    ("\n\nHello", (None, "Hello")),
    ("<think></think>Hi", (None, "Hi")),
    ("  \n<think>a < b</think>  b\n", ("a < b", "b\n")),
    ("<think>a</think>\n\n", ("a", None)),
    ("<think>x</think>y</think>z", ("x", "y</think>z")),  # only the first end tag counts
    ("I said </think> here", (None, "I said </think> here")),  # no thought was opened
    ("<thinking>no</think>", (None, "<thinking>no</think>")),
    ("<thi", (None, "<thi")),
    ("", (None, None)),
    (" \n ", (None, None)),
]

DEEPSEEK_R1 = [
    ("Let me think.\n</think>\n\nAnswer: 4.", ("Let me think.\n", "Answer: 4.")),
    ("<think>\nrepeated start\n</think>ok", ("\nrepeated start\n", "ok")),
    (" <think>x</think>", ("x", None)),
    ("still thinking, cut off", ("still thinking, cut off", None)),
    ("  leading space kept</think> c", ("  leading space kept", "c")),
    ("</think>just content", (None, "just content")),
    ("<thi", ("<thi", None)),
    ("", (None, None)),
    ("\n", ("\n", None)),
]


@pytest.mark.parametrize(("text", "expected"), QWEN3)
def test_qwen3(text, expected):
    assert assert_stream_matches_split(Qwen3ReasoningParser(), text) == expected


@pytest.mark.parametrize(("text", "expected"), DEEPSEEK_R1)
def test_deepseek_r1(text, expected):
    assert assert_stream_matches_split(DeepSeekR1ReasoningParser(), text) == expected


@pytest.mark.parametrize("parser", [Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()])
def test_stream_matches_split_on_random_outputs(parser):
    pieces = ["<think>", "</think>", "<thi", "</th", "<", "think>", "a", "b c", " ", "\n", "é"]
    rng = random.Random(7)
    seen = set()
    for _ in range(250):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        reasoning, content = assert_stream_matches_split(parser, text, seeds=range(2),
                                                         largest=6)
        seen.add((reasoning is None, content is None))
    assert len(seen) == 4  # outputs with and without each part were all tried


def test_stream_holds_back_partial_tags():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("\n<thi") == ("", "")
    assert stream.feed("nk>abc</th") == ("abc", "")
    assert not stream.ended
    assert stream.feed("ink>\n") == ("", "")
    assert stream.ended
    assert stream.feed("\nHi <") == ("", "Hi <")
    assert stream.finish() == ("", "")

    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b") == ("</b", "")
    assert stream.finish() == ("", "")


def test_ended_without_reasoning():
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("  ") == ("", "")
    assert not stream.ended  # a <think> may still come
    assert stream.feed("Hello") == ("", "Hello")
    assert stream.ended
    stream = DeepSeekR1ReasoningParser().stream()
    assert stream.feed("Hello") == ("Hello", "")
    assert not stream.ended


def test_tags_for_token_lookup():
    for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser):
        assert (parser.start_tag, parser.end_tag) == ("<think>", "</think>")


def test_registry():
    assert REASONING_PARSERS == {"qwen3": Qwen3ReasoningParser,
                                 "deepseek_r1": DeepSeekR1ReasoningParser}
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    with pytest.raises(ValueError, match=r"--reasoning-parser.*'granite'.*deepseek_r1, qwen3"):
        get_reasoning_parser("granite")
