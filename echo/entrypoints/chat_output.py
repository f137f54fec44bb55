"""One chat choice's output as OpenAI's message: reasoning (--reasoning-parser), then content,
with tool calls parsed from the content part only; whole, or as streamed deltas.
"""

import uuid

from echo.entrypoints.parsers import ReasoningParser, ToolCallDelta, ToolParser


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None):
        self.reasoning, self.tools = reasoning, tools
        self._reasoning_stream = reasoning.stream() if reasoning else None
        self._tool_stream = tools.stream() if tools else None
        self._call_ids: dict[int, str] = {}  # streamed calls: index -> id
        self.called_tools = False

    def message(self, text: str) -> dict:
        """The final message's fields besides the role."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        message = {}
        if self.reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        calls = []
        if self.tools and content:
            parsed = self.tools.parse(content)
            content, calls = parsed.content, parsed.tool_calls
        message["content"] = content if content or not self.tools else None
        if calls:
            self.called_tools = True
            message["tool_calls"] = [
                {"id": new_tool_call_id(), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for call in calls]
        return message

    def delta(self, text: str, last: bool) -> dict:
        """The delta's fields for the next text of the output (all of it flushed when last);
        empty when everything new is held back (a tag that may be starting)."""
        reasoning, content = "", text
        if self._reasoning_stream is not None:
            reasoning, content = self._reasoning_stream.feed(text)
            if last:
                more_reasoning, more_content = self._reasoning_stream.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCallDelta] = []
        if self._tool_stream is not None:
            content, calls = self._tool_stream.feed(content) if content else ("", [])
            if last:
                more_content, more_calls = self._tool_stream.finish()
                content, calls = content + more_content, calls + more_calls
        delta = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            self.called_tools = True
            delta["tool_calls"] = [self._call_json(call) for call in calls]
        return delta

    def _call_json(self, call: ToolCallDelta) -> dict:
        entry = {"index": call.index}
        function = {"arguments": call.arguments}
        if call.index not in self._call_ids:  # a call's first delta: its id, type and name
            self._call_ids[call.index] = entry["id"] = new_tool_call_id()
            entry["type"] = "function"
            function["name"] = call.name
        entry["function"] = function
        return entry
