"""A chat request's tools and tool_choice, as vLLM takes them.

tool_choice "none" leaves the output alone; "auto" (the default when tools are given) parses
the model's own tool-call format, which needs the server's --enable-auto-tool-choice and
--tool-call-parser; "required" and a named function need no flag: a grammar forces the
output into a JSON array of calls (required) or the named function's arguments, so the calls
are valid for their schemas whatever the model.
"""

from dataclasses import dataclass

from echo.entrypoints.parsers import get_tool_parser
from echo.entrypoints.parsers.tool_parsers import (
    NamedToolCallParser,
    RequiredToolCallsParser,
    ToolParser,
    tool_choice_json_schema,
)
from echo.sampling_params import StructuredOutputsParams

TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its output."""

    mode: str  # none, auto, required or named
    tools: tuple[dict, ...] = ()
    name: str | None = None  # the named function

    @staticmethod
    def create(tools: list | None, tool_choice) -> "ToolPlan":
        """ValueError naming the field for malformed tools or a choice they cannot meet."""
        tools = tools or []
        if not isinstance(tools, list):
            raise ValueError("tools: must be a list of tools")
        names = [_function_name(i, tool) for i, tool in enumerate(tools)]
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if isinstance(tool_choice, str):
            if tool_choice not in TOOL_CHOICE_MODES:
                raise ValueError(f"tool_choice: {tool_choice!r} is not one of "
                                 f"{', '.join(TOOL_CHOICE_MODES)} or a named function")
            if tool_choice != "none" and not tools:
                raise ValueError(f"tool_choice: {tool_choice!r} needs tools")
            return ToolPlan(tool_choice, tuple(tools))
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice: a named choice is "
                             '{"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise ValueError(f"tool_choice: {name!r} is not among the tools "
                             f"({', '.join(names) or 'none given'})")
        return ToolPlan("named", tuple(tools), name)

    def constraint_field(self) -> str:
        """The request field a grammar error in constraint() comes from: the named function's
        parameters, or the tools (required: an array of any of them)."""
        if self.mode == "named":
            index = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.name)
            return f"tools[{index}].function.parameters"
        return "tools"

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces a required or named choice."""
        if self.mode == "required":
            return StructuredOutputsParams(json=tool_choice_json_schema(list(self.tools)))
        if self.mode == "named":
            function = next(t["function"] for t in self.tools
                            if t["function"]["name"] == self.name)
            return StructuredOutputsParams(json=function.get("parameters")
                                           or {"type": "object"})
        return None

    def parser(self, auto_parser: str | None) -> ToolParser | None:
        """The parser of the output's tool calls (None: the output is all content)."""
        if self.mode == "required":
            return RequiredToolCallsParser()
        if self.mode == "named":
            return NamedToolCallParser(self.name)
        if self.mode == "auto" and auto_parser is not None:
            return get_tool_parser(auto_parser)()
        return None


def _function_name(index: int, tool) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not (isinstance(tool, dict) and tool.get("type", "function") == "function"
            and isinstance(function, dict) and isinstance(function.get("name"), str)
            and function["name"]):
        raise ValueError(f"tools[{index}]: must be "
                         '{"type": "function", "function": {"name": ..., "parameters": ...}}')
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ValueError(f"tools[{index}].function.parameters: must be a JSON schema object")
    return function["name"]
