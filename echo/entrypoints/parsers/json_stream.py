"""Incremental scanning of the JSON a model writes for its tool calls, as the text streams in.

A tool call is an object {"name": "f", "arguments": {...}} (the arguments key depends on the
format). A client streaming the call wants the name once it is complete, then the arguments'
text as it arrives, so the scanners are character state machines fed chunk by chunk: each
character is looked at once and nothing is re-parsed, so a call costs O(its length) however it
is chunked. They check structure (brackets, strings, keys, separators), not the spelling of
numbers and literals inside the arguments: a caller that needs the full check runs json.loads
on the finished text.
"""

import json
import re
from dataclasses import dataclass
from enum import Enum, auto

WHITESPACE = " \t\n\r"

# runs of characters with no meaning to the scanner, skipped at C speed
_STRING_BODY_END = re.compile(r'["\\]')
_CONTAINER_BODY_END = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[,}\]\s]")
_SCALAR_START = frozenset("-0123456789tfnNI")  # json.loads also reads NaN and Infinity
_OPENER = {"}": "{", "]": "["}


@dataclass(frozen=True)
class NameDone:
    """The call's "name" string is complete."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsFragment:
    """More of the raw JSON text of the call's arguments value."""

    index: int
    text: str


@dataclass(frozen=True)
class ObjectDone:
    """The call's object is closed."""

    index: int


ScanEvent = NameDone | ArgumentsFragment | ObjectDone


class _ValueScanner:
    """Finds where one JSON value ends, across chunks: brackets nest, strings hide them, and a
    number or literal ends at the first delimiter after it."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._stack: list[str] = []  # open brackets
        self._in_string = False
        self._escaped = False  # the last string character was a backslash
        self._in_scalar = False

    def scan(self, text: str, pos: int) -> tuple[int, bool]:
        """Consume text[pos:end]; (end, True) if the value ends at end. A number or literal ends
        before its delimiter, which is left for the caller."""
        stack = self._stack
        n = len(text)
        while pos < n:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    pos += 1
                    continue
                found = _STRING_BODY_END.search(text, pos)
                if found is None:
                    return n, False
                pos = found.end()
                if found.group() == "\\":
                    self._escaped = True
                    continue
                self._in_string = False
                if not stack:
                    return pos, True
                continue
            if self._in_scalar:
                found = _SCALAR_END.search(text, pos)
                if found is None:
                    return n, False
                return found.start(), True
            if stack:
                found = _CONTAINER_BODY_END.search(text, pos)
                if found is None:
                    return n, False
                pos = found.start()
            c = text[pos]
            if c == '"':
                self._in_string = True
            elif c in "{[":
                stack.append(c)
            elif c in "}]" and stack:
                if stack[-1] != _OPENER[c]:
                    self.error = f"unmatched {c!r}"
                    return pos, False
                stack.pop()
                if not stack:
                    return pos + 1, True
            elif c in _SCALAR_START:  # outside brackets: only the value's first character
                self._in_scalar = True
                continue
            else:
                self.error = f"no JSON value starts with {c!r}"
                return pos, False
            pos += 1
        return n, False


class _State(Enum):
    OPEN = auto()  # before "{"
    KEY_OR_CLOSE = auto()  # after "{"
    KEY = auto()  # after ","
    COLON = auto()
    VALUE_START = auto()
    IN_VALUE = auto()
    AFTER_VALUE = auto()
    DONE = auto()
    FAILED = auto()


class _Role(Enum):
    KEY = auto()
    NAME = auto()
    ARGUMENTS = auto()
    SKIPPED = auto()  # the value of a key the call does not use ("type", "id", ...)


class ToolObjectScanner:
    """Scans one tool call object, reporting NameDone, ArgumentsFragments and ObjectDone.

    Concatenating the fragments gives exactly the raw text of the arguments value, without the
    whitespace around it. Arguments written before the name are held until the name is known,
    so a client always learns the name first. The first occurrence of "name" and of an
    arguments key counts; a later duplicate is skipped. An object without a "name" string is an
    error, found when it closes."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("arguments",), index: int = 0):
        self.index = index
        self.error: str | None = None
        self._arguments_keys = arguments_keys
        self._state = _State.OPEN
        self._role = _Role.KEY
        self._value = _ValueScanner()
        self._raw: list[str] = []  # the text of the key or name string being read
        self._key = ""
        self._name: str | None = None
        self._has_arguments = False
        self._arguments_before_name: list[str] = []

    @property
    def done(self) -> bool:
        return self._state is _State.DONE

    def feed(self, text: str) -> list[ScanEvent]:
        """Scan a whole chunk; anything after the closing brace is ignored."""
        events: list[ScanEvent] = []
        self.scan(text, 0, events)
        return events

    def scan(self, text: str, pos: int, events: list[ScanEvent]) -> int:
        """Scan text[pos:], appending events; returns where scanning stopped: len(text), just
        past the closing brace, or (with self.error set) at the character that broke the
        object."""
        n = len(text)
        while pos < n:
            state = self._state
            if state is _State.IN_VALUE:
                pos = self._scan_value(text, pos, events)
                continue
            if state is _State.DONE or state is _State.FAILED:
                break
            c = text[pos]
            if c in WHITESPACE:
                pos += 1
            elif state is _State.OPEN:
                if c != "{":
                    return self._fail("a tool call must be a JSON object", pos)
                self._state = _State.KEY_OR_CLOSE
                pos += 1
            elif state is _State.KEY_OR_CLOSE or state is _State.KEY:
                if c == '"':
                    self._start_value(_Role.KEY)
                elif c == "}" and state is _State.KEY_OR_CLOSE:
                    return self._close(pos, events)
                else:
                    return self._fail("expected a key", pos)
            elif state is _State.COLON:
                if c != ":":
                    return self._fail("expected ':'", pos)
                self._state = _State.VALUE_START
                pos += 1
            elif state is _State.VALUE_START:
                if self._key == "name" and self._name is None:
                    if c != '"':
                        return self._fail("the name must be a string", pos)
                    self._start_value(_Role.NAME)
                elif self._key in self._arguments_keys and not self._has_arguments:
                    self._has_arguments = True
                    self._start_value(_Role.ARGUMENTS)
                else:
                    self._start_value(_Role.SKIPPED)
            elif c == ",":  # AFTER_VALUE
                self._state = _State.KEY
                pos += 1
            elif c == "}":
                return self._close(pos, events)
            else:
                return self._fail("expected ',' or '}'", pos)
        return pos

    def _start_value(self, role: _Role) -> None:
        self._role = role
        self._value = _ValueScanner()
        self._state = _State.IN_VALUE

    def _scan_value(self, text: str, pos: int, events: list[ScanEvent]) -> int:
        end, finished = self._value.scan(text, pos)
        if self._value.error:
            return self._fail(self._value.error, end)
        piece = text[pos:end]
        role = self._role
        if role is _Role.KEY or role is _Role.NAME:
            self._raw.append(piece)
        elif role is _Role.ARGUMENTS and piece:
            if self._name is None:
                self._arguments_before_name.append(piece)
            else:
                events.append(ArgumentsFragment(self.index, piece))
        if finished:
            self._end_value(events, end)
        return end

    def _end_value(self, events: list[ScanEvent], pos: int) -> None:
        self._state = _State.AFTER_VALUE
        if self._role is _Role.KEY or self._role is _Role.NAME:
            try:
                decoded = json.loads("".join(self._raw))
            except ValueError:
                self._fail("invalid string", pos)
                return
            self._raw = []
            if self._role is _Role.KEY:
                self._key = decoded
                self._state = _State.COLON
                return
            self._name = decoded
            events.append(NameDone(self.index, decoded))
            if self._arguments_before_name:
                events.append(ArgumentsFragment(self.index, "".join(self._arguments_before_name)))
                self._arguments_before_name = []

    def _close(self, pos: int, events: list[ScanEvent]) -> int:
        if self._name is None:
            return self._fail('a tool call needs a "name" string', pos)
        self._state = _State.DONE
        events.append(ObjectDone(self.index))
        return pos + 1

    def _fail(self, message: str, pos: int) -> int:
        self.error = message
        self._state = _State.FAILED
        return pos


class _ArrayState(Enum):
    OPEN = auto()  # before "["
    FIRST = auto()  # after "[": an object or "]"
    NEXT = auto()  # after ",": an object
    IN_OBJECT = auto()
    AFTER_OBJECT = auto()
    DONE = auto()
    FAILED = auto()


class ToolArrayScanner:
    """Scans a JSON array of tool call objects ([{"name": ..., "parameters": {...}}, ...], the
    format the engine's grammar forces for tool_choice "required"); each object's events carry
    its position in the array."""

    def __init__(self, arguments_keys: tuple[str, ...] = ("parameters",)):
        self.error: str | None = None
        self.count = 0  # objects closed so far
        self._arguments_keys = arguments_keys
        self._state = _ArrayState.OPEN
        self._object = ToolObjectScanner(arguments_keys)

    @property
    def done(self) -> bool:
        return self._state is _ArrayState.DONE

    def feed(self, text: str) -> list[ScanEvent]:
        events: list[ScanEvent] = []
        self.scan(text, 0, events)
        return events

    def scan(self, text: str, pos: int, events: list[ScanEvent]) -> int:
        """As ToolObjectScanner.scan, for the array."""
        n = len(text)
        while pos < n:
            state = self._state
            if state is _ArrayState.IN_OBJECT:
                pos = self._object.scan(text, pos, events)
                if self._object.error:
                    return self._fail(self._object.error, pos)
                if self._object.done:
                    self.count += 1
                    self._state = _ArrayState.AFTER_OBJECT
                continue
            if state is _ArrayState.DONE or state is _ArrayState.FAILED:
                break
            c = text[pos]
            if c in WHITESPACE:
                pos += 1
            elif state is _ArrayState.OPEN:
                if c != "[":
                    return self._fail("the tool calls must be a JSON array", pos)
                self._state = _ArrayState.FIRST
                pos += 1
            elif c == "{" and (state is _ArrayState.FIRST or state is _ArrayState.NEXT):
                self._object = ToolObjectScanner(self._arguments_keys, index=self.count)
                self._state = _ArrayState.IN_OBJECT
            elif c == "]" and (state is _ArrayState.FIRST or state is _ArrayState.AFTER_OBJECT):
                self._state = _ArrayState.DONE
                return pos + 1
            elif c == "," and state is _ArrayState.AFTER_OBJECT:
                self._state = _ArrayState.NEXT
                pos += 1
            else:
                return self._fail(f"unexpected {c!r} in the array", pos)
        return pos

    def _fail(self, message: str, pos: int) -> int:
        self.error = message
        self._state = _ArrayState.FAILED
        return pos
