"""Tool calls in a model's text, parsed whole or streamed, for vLLM's --tool-call-parser formats
and the formats the engine's own tool_choice grammars force.

Choices shared by every parser:
- content is the text outside tool calls with its surrounding whitespace stripped (None when
  nothing is left); a stream holds back whitespace at the end of what it has sent until more
  content follows, so its content deltas add up to the same text.
- parse() writes arguments as json.dumps(value, ensure_ascii=False); a stream sends the model's
  own text of the value, which decodes to the same value. A call without arguments gets "{}".
- A stream commits to a call when its name is complete (that is when the client first hears
  of it). A call found malformed before then is content, exactly as parse() leaves it; one
  found malformed later (JSON that breaks after the name, a cut-off output) has been sent, so
  the stream drops the rest of its markup while parse() leaves the whole block as content.
"""

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

from echo.entrypoints.parsers.json_stream import (
    WHITESPACE,
    ArgumentsFragment,
    NameDone,
    ObjectDone,
    ScanEvent,
    ToolArrayScanner,
    ToolObjectScanner,
)
from echo.entrypoints.parsers.tags import held_tag_start

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    """A finished call (the server assigns its id)."""

    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True)
class ToolCallDelta:
    """One call's part of an OpenAI streaming delta."""

    index: int  # which call (0, 1, ...) in this message
    name: str | None = None  # set once, on the call's first delta
    arguments: str = ""  # a fragment of the arguments JSON text


@dataclass(frozen=True)
class ParsedMessage:
    content: str | None  # text outside tool calls (None if empty/whitespace only)
    tool_calls: list[ToolCall]


class ToolStream(ABC):
    """The streaming state of one choice."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next text of the output -> (content delta, call deltas)."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: flush what was held back."""


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedMessage: ...

    @abstractmethod
    def stream(self) -> ToolStream:
        """A fresh streaming state, one per choice."""


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def _tool_call(value, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """The call a decoded JSON value describes, or None if it describes none."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    # the first arguments key in the text wins, as in the stream
    key = next((k for k in value if k in arguments_keys), None)
    arguments = value[key] if key is not None else {}
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _content(pieces: list[str]) -> str | None:
    return "".join(pieces).strip() or None


class _TrimmedText:
    """Streams a text stripped of its surrounding whitespace, as parse() returns it: leading
    whitespace is dropped, trailing whitespace waits until more text follows it."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        sent = self._held + body
        self._held = text[len(body):]
        return sent


class _Deltas:
    """Turns scan events into deltas, merging consecutive ones of a call so that a chunk says
    each thing once."""

    def __init__(self) -> None:
        self._deltas: list[ToolCallDelta] = []
        self._with_arguments: set[int] = set()

    def add_events(self, events: list[ScanEvent]) -> None:
        for event in events:
            if isinstance(event, NameDone):
                self.add(ToolCallDelta(event.index, name=event.name))
            elif isinstance(event, ArgumentsFragment):
                self.add(ToolCallDelta(event.index, arguments=event.text))
            elif event.index not in self._with_arguments:  # ObjectDone
                self.add(ToolCallDelta(event.index, arguments="{}"))

    def add(self, delta: ToolCallDelta) -> None:
        if delta.arguments:
            self._with_arguments.add(delta.index)
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.index == delta.index and delta.name is None:
            self._deltas[-1] = replace(last, arguments=last.arguments + delta.arguments)
        else:
            self._deltas.append(delta)

    def take(self) -> list[ToolCallDelta]:
        deltas, self._deltas = self._deltas, []
        return deltas


class _ScannedCall:
    """One call being scanned by a stream: committed once its name is out, and until then its
    raw text is kept, to become content if the call turns out malformed."""

    def __init__(self, scanner: ToolObjectScanner, prefix: str):
        self.scanner = scanner
        self.committed = False
        self.held = [prefix]

    def scan(self, text: str, pos: int, deltas: _Deltas) -> int:
        events: list[ScanEvent] = []
        end = self.scanner.scan(text, pos, events)
        if not self.committed:
            self.held.append(text[pos:end])
            if any(isinstance(e, NameDone) for e in events):
                self.committed = True
                self.held = []
        deltas.add_events(events)
        return end


class _CallTextStream(ToolStream):
    """A stream over text that mixes content and call objects: a mode method per place in
    the format reads on from a position, returning where the next mode takes over."""

    _mode: Callable[[str, int, list[str]], int]  # set by each subclass

    def __init__(self, arguments_keys: tuple[str, ...]):
        self._arguments_keys = arguments_keys
        self._held = ""  # the end of the last chunk, which the next chunk must settle
        self._call: _ScannedCall | None = None
        self._calls = 0  # calls committed so far
        self._content = _TrimmedText()
        self._deltas = _Deltas()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        text, self._held = self._held + text, ""
        content: list[str] = []
        pos = 0
        while pos < len(text):
            pos = self._mode(text, pos, content)
        return self._content.feed("".join(content)), self._deltas.take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, self._held = self._unsent_content(), ""
        return self._content.feed(content), self._deltas.take()

    @abstractmethod
    def _unsent_content(self) -> str:
        """What the output's end leaves as content of the text held back."""

    def _start_call(self, prefix: str) -> None:
        self._call = _ScannedCall(ToolObjectScanner(self._arguments_keys, self._calls), prefix)
        self._mode = self._call_mode

    def _scan_call(self, text: str, pos: int) -> int:
        was_committed = self._call.committed
        pos = self._call.scan(text, pos, self._deltas)
        if self._call.committed and not was_committed:
            self._calls += 1
        return pos

    @abstractmethod
    def _call_mode(self, text: str, pos: int, content: list[str]) -> int:
        """Inside a call object."""


HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"


class HermesToolParser(ToolParser):
    """<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, possibly several, with
    content around them (Qwen2.5, Qwen3). A block whose JSON is not a call is content; the
    last block may lack its end tag."""

    arguments_keys = ("arguments",)

    def parse(self, text: str) -> ParsedMessage:
        outside, calls = [], []
        pos = 0
        while (start := text.find(HERMES_START, pos)) >= 0:
            outside.append(text[pos:start])
            found = self._parse_block(text, start + len(HERMES_START))
            if found is not None:
                calls.append(found[0])
                pos = found[1]
                continue
            end = text.find(HERMES_END, start + len(HERMES_START))
            pos = len(text) if end < 0 else end + len(HERMES_END)
            outside.append(text[start:pos])
        outside.append(text[pos:])
        return ParsedMessage(_content(outside), calls)

    def _parse_block(self, text: str, pos: int) -> tuple[ToolCall, int] | None:
        """(the call, where its block ends) for a well-formed block whose JSON starts after pos;
        the JSON decides where it ends, so an end tag inside a string is no end."""
        try:
            value, end = _DECODER.raw_decode(text, _skip_whitespace(text, pos))
        except ValueError:
            return None
        call = _tool_call(value, self.arguments_keys)
        if call is None:
            return None
        end = _skip_whitespace(text, end)
        if text.startswith(HERMES_END, end):
            return call, end + len(HERMES_END)
        return (call, end) if end == len(text) else None

    def stream(self) -> ToolStream:
        return _HermesStream(self.arguments_keys)


class _HermesStream(_CallTextStream):
    def __init__(self, arguments_keys: tuple[str, ...]):
        super().__init__(arguments_keys)
        self._mode = self._content_mode

    def _unsent_content(self) -> str:
        if self._mode in (self._content_mode, self._malformed_mode):
            return self._held
        if self._mode == self._call_mode and not self._call.committed:
            return "".join(self._call.held)  # cut off before its name: never a call
        return ""  # the markup of a call already sent

    def _content_mode(self, text: str, pos: int, content: list[str]) -> int:
        start = text.find(HERMES_START, pos)
        if start < 0:
            held = held_tag_start(text, HERMES_START, pos)
            content.append(text[pos:held])
            self._held = text[held:]
            return len(text)
        content.append(text[pos:start])
        self._start_call(HERMES_START)
        return start + len(HERMES_START)

    def _call_mode(self, text: str, pos: int, content: list[str]) -> int:
        call = self._call
        pos = self._scan_call(text, pos)
        if call.scanner.error:
            if call.committed:
                self._mode = self._dropped_mode
            else:
                content.extend(call.held)
                self._mode = self._malformed_mode
        elif call.scanner.done:
            self._mode = self._end_tag_mode
        return pos

    def _end_tag_mode(self, text: str, pos: int, content: list[str]) -> int:
        pos = _skip_whitespace(text, pos)
        if text.startswith(HERMES_END, pos):
            self._mode = self._content_mode
            return pos + len(HERMES_END)
        if len(text) - pos < len(HERMES_END) and HERMES_END.startswith(text[pos:]):
            self._held = text[pos:]
            return len(text)
        if pos < len(text):
            self._mode = self._dropped_mode  # text after a sent call, inside its block
        return pos

    def _malformed_mode(self, text: str, pos: int, content: list[str]) -> int:
        """The rest of a block that is no call, up to its end tag: content."""
        return self._to_end_tag(text, pos, content)

    def _dropped_mode(self, text: str, pos: int, content: list[str]) -> int:
        """The rest of a block whose call was sent before it broke: dropped."""
        return self._to_end_tag(text, pos, [])

    def _to_end_tag(self, text: str, pos: int, out: list[str]) -> int:
        end = text.find(HERMES_END, pos)
        if end < 0:
            held = held_tag_start(text, HERMES_END, pos)
            out.append(text[pos:held])
            self._held = text[held:]
            return len(text)
        self._mode = self._content_mode
        out.append(text[pos:end + len(HERMES_END)])
        return end + len(HERMES_END)


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2 JSON tool calling: the whole output is one call object
    {"name": ..., "parameters": {...}} ("arguments" also read), or several separated by ";",
    optionally after <|python_tag|>. An output that does not start (after whitespace and the
    tag) with "{" is content, and so is one whose calls do not all parse."""

    arguments_keys = ("parameters", "arguments")

    def parse(self, text: str) -> ParsedMessage:
        pos = _skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, pos):
            pos = _skip_whitespace(text, pos + len(PYTHON_TAG))
        if not text.startswith("{", pos):
            return ParsedMessage(_content([text]), [])
        calls = []
        while True:
            try:
                value, pos = _DECODER.raw_decode(text, pos)
            except ValueError:
                return ParsedMessage(_content([text]), [])
            call = _tool_call(value, self.arguments_keys)
            if call is None:
                return ParsedMessage(_content([text]), [])
            calls.append(call)
            pos = _skip_whitespace(text, pos)
            if pos == len(text):
                return ParsedMessage(None, calls)
            if text[pos] != ";":
                return ParsedMessage(_content([text]), [])
            pos = _skip_whitespace(text, pos + 1)
            if pos == len(text):  # a ";" at the very end is tolerated
                return ParsedMessage(None, calls)

    def stream(self) -> ToolStream:
        return _Llama3JsonStream(self.arguments_keys)


class _Llama3JsonStream(_CallTextStream):
    def __init__(self, arguments_keys: tuple[str, ...]):
        super().__init__(arguments_keys)
        self._mode = self._prefix_mode  # self._held: the output's start, until it is settled

    def _unsent_content(self) -> str:
        if self._mode == self._prefix_mode:
            return self._held
        if self._mode == self._call_mode and self._calls == 0:
            return "".join(self._call.held)  # the first call cut off: the output is content
        return ""

    def _prefix_mode(self, text: str, pos: int, content: list[str]) -> int:
        first = _skip_whitespace(text, pos)
        if text.startswith(PYTHON_TAG, first):
            first = _skip_whitespace(text, first + len(PYTHON_TAG))
        elif len(text) - first < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[first:]):
            first = len(text)  # whitespace or a part of the tag so far
        if first == len(text):
            self._held = text[pos:]
            return first
        if text[first] != "{":
            self._mode = self._content_mode
            return pos
        self._start_call(text[pos:first])
        return first

    def _call_mode(self, text: str, pos: int, content: list[str]) -> int:
        call = self._call
        pos = self._scan_call(text, pos)
        if call.scanner.error:
            if self._calls == 0:  # nothing sent: the whole output is content
                content.extend(call.held)
                self._mode = self._content_mode
            else:
                self._mode = self._dropped_mode
        elif call.scanner.done:
            self._mode = self._separator_mode
        return pos

    def _separator_mode(self, text: str, pos: int, content: list[str]) -> int:
        pos = _skip_whitespace(text, pos)
        if pos < len(text):
            if text[pos] == ";":
                self._mode = self._next_call_mode
                return pos + 1
            self._mode = self._dropped_mode
        return pos

    def _next_call_mode(self, text: str, pos: int, content: list[str]) -> int:
        pos = _skip_whitespace(text, pos)
        if pos < len(text):
            if text[pos] == "{":
                self._start_call("")
            else:
                self._mode = self._dropped_mode
        return pos

    def _content_mode(self, text: str, pos: int, content: list[str]) -> int:
        content.append(text[pos:])
        return len(text)

    def _dropped_mode(self, text: str, pos: int, content: list[str]) -> int:
        """Text after calls already sent that is no call: dropped."""
        return len(text)


class RequiredToolCallsParser(ToolParser):
    """tool_choice "required": the engine's grammar (tool_choice_json_schema) makes the whole
    output a JSON array of {"name": ..., "parameters": {...}}. parse() keeps the calls whose
    objects closed with arguments that decode, so an output cut off by max_tokens keeps the
    calls it finished."""

    arguments_keys = ("parameters", "arguments")

    def parse(self, text: str) -> ParsedMessage:
        names: dict[int, str] = {}
        arguments: dict[int, list[str]] = {}
        calls = []
        for event in ToolArrayScanner(self.arguments_keys).feed(text):
            if isinstance(event, NameDone):
                names[event.index] = event.name
            elif isinstance(event, ArgumentsFragment):
                arguments.setdefault(event.index, []).append(event.text)
            elif isinstance(event, ObjectDone):
                try:
                    value = json.loads("".join(arguments.get(event.index, ["{}"])))
                except ValueError:
                    continue
                calls.append(ToolCall(names[event.index], json.dumps(value, ensure_ascii=False)))
        return ParsedMessage(None, calls)

    def stream(self) -> ToolStream:
        return _RequiredStream(self.arguments_keys)


class _RequiredStream(ToolStream):
    def __init__(self, arguments_keys: tuple[str, ...]):
        self._scanner = ToolArrayScanner(arguments_keys)
        self._deltas = _Deltas()

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        events: list[ScanEvent] = []
        self._scanner.scan(text, 0, events)  # stops for good at the array's end or an error
        self._deltas.add_events(events)
        return "", self._deltas.take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []


class NamedToolCallParser(ToolParser):
    """tool_choice naming one function: the grammar makes the whole output its arguments
    object."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str) -> ParsedMessage:
        return ParsedMessage(None, [ToolCall(self.name, text.strip())])

    def stream(self) -> ToolStream:
        return _NamedStream(self.name)


class _NamedStream(ToolStream):
    def __init__(self, name: str):
        self._name = name
        self._named = False
        self._arguments = _TrimmedText()  # as parse(): the text without surrounding whitespace

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        deltas = _Deltas()
        if not self._named:
            self._named = True
            deltas.add(ToolCallDelta(0, name=self._name))
        fragment = self._arguments.feed(text)
        if fragment:
            deltas.add(ToolCallDelta(0, arguments=fragment))
        return "", deltas.take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("")


def tool_choice_json_schema(tools: list[dict]) -> dict:
    """The JSON schema of the array RequiredToolCallsParser reads, for the grammar that
    tool_choice "required" imposes: at least one call, each naming one of the tools and giving
    arguments that fit its parameters. tools are OpenAI tool dicts
    {"type": "function", "function": {"name", "description", "parameters"}}."""
    choices = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters")
        choices.append({
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": {"type": "object"} if parameters is None else parameters,
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    return {"type": "array", "minItems": 1, "items": {"anyOf": choices}}
