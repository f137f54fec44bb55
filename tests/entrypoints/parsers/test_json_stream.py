"""The tool call scanners against hand-written events, fed whole, a character at a time and in
random chunks: the name exactly decoded, the arguments' raw text exactly as written."""

import json
import random

import pytest

from echo.entrypoints.parsers.json_stream import (
    ArgumentsFragment,
    NameDone,
    ObjectDone,
    ToolArrayScanner,
    ToolObjectScanner,
)


def chunkings(text: str, seeds=range(5), largest: int = 12):
    """The ways the tests cut a text: whole, a character at a time, and random sizes."""
    yield [text]
    yield list(text)
    for seed in seeds:
        rng = random.Random(seed)
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, largest)
            chunks.append(text[pos:pos + size])
            pos += size
        yield chunks


def scan_chunks(scanner, chunks) -> list:
    events = []
    for chunk in chunks:
        scanner.scan(chunk, 0, events)
    return events


def merged(events) -> list:
    """Consecutive fragments of a call as one, so that cuttings can be compared."""
    out = []
    for event in events:
        if (out and isinstance(event, ArgumentsFragment) and isinstance(out[-1], ArgumentsFragment)
                and out[-1].index == event.index):
            out[-1] = ArgumentsFragment(event.index, out[-1].text + event.text)
        else:
            out.append(event)
    return out


def assert_object_events(text, name, raw_arguments, keys=("arguments",)):
    for chunks in chunkings(text):
        scanner = ToolObjectScanner(keys)
        events = scan_chunks(scanner, chunks)
        assert scanner.error is None
        assert scanner.done
        assert isinstance(events[0], NameDone)  # the name before any argument text
        assert all(e.text for e in events if isinstance(e, ArgumentsFragment))
        assert merged(events) == [NameDone(0, name), ArgumentsFragment(0, raw_arguments),
                                  ObjectDone(0)]


def test_name_then_arguments():
    text = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert ToolObjectScanner().feed(text) == [
        NameDone(0, "get_weather"), ArgumentsFragment(0, '{"city": "Paris"}'), ObjectDone(0)]
    assert_object_events(text, "get_weather", '{"city": "Paris"}')


def test_escapes_braces_in_strings_and_nesting():
    arguments = (r'{"q": "a \"}\" {[", "u": "\ud83d\ude00 \u00e9", "path": "C:\\dir\\", '
                 r'"n": [1, {"x": [true, null, -2.5e3]}], "e": {}}')
    text = r'{"name": "say_\"hi\"_\u00e9", "arguments": ' + arguments + "}"
    assert_object_events(text, 'say_"hi"_é', arguments)
    assert json.loads(arguments) == {"q": 'a "}" {[', "u": "😀 é", "path": "C:\\dir\\",
                                     "n": [1, {"x": [True, None, -2500.0]}], "e": {}}


def test_whitespace_anywhere_is_not_part_of_the_arguments():
    text = ' \n {\n  "name" :\n "f" ,\n\t"arguments"  :  {  "a" : [ 1 , 2 ] }  \n } '
    assert_object_events(text, "f", '{  "a" : [ 1 , 2 ] }')


def test_arguments_before_the_name_wait_for_it():
    text = '{"arguments": {"city": "Paris", "days": [1, 2]}, "name": "get_weather"}'
    assert_object_events(text, "get_weather", '{"city": "Paris", "days": [1, 2]}')
    scanner = ToolObjectScanner()
    events = scan_chunks(scanner, list(text[:-len('get_weather"}')]))
    assert events == []


def test_other_keys_are_skipped_and_the_arguments_key_is_configurable():
    text = ('{"type": "function", "id": {"k": "}]"}, "name": "f", "arguments": {"no": 1}, '
            '"parameters": {"yes": [2]}, "extra": [1, "]"]}')
    assert_object_events(text, "f", '{"yes": [2]}', keys=("parameters",))
    assert_object_events(text, "f", '{"no": 1}', keys=("parameters", "arguments"))


def test_first_name_counts():
    text = '{"name": "a", "name": "b", "arguments": {}}'
    assert_object_events(text, "a", "{}")


@pytest.mark.parametrize("arguments", ["123", '"{\\"a\\": 1}"', "-0.5", "null", "[1, [2]]"])
def test_non_object_arguments_are_passed_as_written(arguments):
    assert_object_events('{"name": "f", "arguments": ' + arguments + "}", "f", arguments)
    assert_object_events('{"name": "f", "arguments": ' + arguments + ' , "x": 1}', "f",
                         arguments)


def test_chunk_boundaries_inside_escapes():
    chunks = ['{"name": "a\\', '"b", "arguments": {"s": "\\', "u00e9\\", '"x\\\\', '"}}']
    scanner = ToolObjectScanner()
    assert merged(scan_chunks(scanner, chunks)) == [
        NameDone(0, 'a"b'), ArgumentsFragment(0, '{"s": "\\u00e9\\"x\\\\"}'), ObjectDone(0)]


def test_scanning_stops_after_the_object():
    text = '{"name": "f", "arguments": {}}\n</tool_call>'
    scanner = ToolObjectScanner()
    assert scanner.scan(text, 0, []) == text.index("\n")
    assert scanner.done
    assert scanner.scan("more", 0, []) == 0  # a finished scanner takes nothing


def test_index_is_reported():
    assert ToolObjectScanner(index=3).feed('{"name": "f", "arguments": 1}') == [
        NameDone(3, "f"), ArgumentsFragment(3, "1"), ObjectDone(3)]


@pytest.mark.parametrize(("text", "message", "at"), [
    ('[{"name": "f"}]', "must be a JSON object", 0),
    ('{"name": 5, "arguments": {}}', "name must be a string", 9),
    ('{"arguments": {}}', '"name"', 16),
    ('{"name": "f", "arguments": {"a": [1}}', "unmatched", 35),
    ('{"name": "f" "arguments": {}}', "expected ',' or '}'", 13),
    ('{name: "f"}', "expected a key", 1),
    ('{"name": "f",}', "expected a key", 13),
    ('{"name": "f", "arguments": }', "no JSON value", 27),
    ('{"name" "f"}', "expected ':'", 8),
    ('{"name": "a\\qb"}', "invalid string", 15),
])
def test_malformed_objects(text, message, at):
    for chunks in chunkings(text, seeds=range(2)):
        scanner = ToolObjectScanner()
        events = scan_chunks(scanner, chunks)
        assert message in scanner.error
        assert not scanner.done
        assert not any(isinstance(e, ObjectDone) for e in events)
    scanner = ToolObjectScanner()
    assert scanner.scan(text, 0, []) == at
    assert scanner.feed('{"name": "g", "arguments": {}}') == []  # it stays failed


ARRAY = ('[{"name": "a", "parameters": {"x": 1}}, '
         '{"parameters": {"y": "]}"}, "type": "function", "name": "b"}]')


def test_array_of_calls():
    for text in (ARRAY, "\n[ \n" + ARRAY[1:-1].replace(", {", " ,\n {") + " \n]"):
        for chunks in chunkings(text):
            scanner = ToolArrayScanner()
            events = scan_chunks(scanner, chunks)
            assert scanner.error is None and scanner.done and scanner.count == 2
            assert merged(events) == [
                NameDone(0, "a"), ArgumentsFragment(0, '{"x": 1}'), ObjectDone(0),
                NameDone(1, "b"), ArgumentsFragment(1, '{"y": "]}"}'), ObjectDone(1)]


def test_empty_array_and_where_scanning_stops():
    scanner = ToolArrayScanner()
    assert scanner.scan("[ ] tail", 0, []) == 3
    assert scanner.done and scanner.count == 0


def test_array_arguments_key_is_configurable():
    text = '[{"name": "a", "arguments": {"x": 1}}]'
    assert ToolArrayScanner(("arguments",)).feed(text)[1] == ArgumentsFragment(0, '{"x": 1}')
    assert ToolArrayScanner(("parameters",)).feed(text) == [NameDone(0, "a"), ObjectDone(0)]


@pytest.mark.parametrize(("text", "message"), [
    ('{"name": "a", "parameters": {}}', "must be a JSON array"),
    ("[1]", "unexpected '1'"),
    ('[{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}]', "unexpected '{'"),
    ('[{"name": "a", "parameters": {}},]', "unexpected ']'"),
    ('[{"parameters": {}}]', '"name"'),
])
def test_malformed_arrays(text, message):
    for chunks in chunkings(text, seeds=range(2)):
        scanner = ToolArrayScanner()
        scan_chunks(scanner, chunks)
        assert message in scanner.error
        assert not scanner.done
