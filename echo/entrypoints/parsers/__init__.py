"""Text parsers for the OpenAI-compatible server: tool calls (--tool-call-parser) and the
reasoning of thinking models (--reasoning-parser), by the names vLLM gives them."""

from echo.entrypoints.parsers.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStream,
)
from echo.entrypoints.parsers.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolCallParser,
    ParsedMessage,
    RequiredToolCallsParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStream,
    tool_choice_json_schema,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def _lookup(registry: dict, name: str, flag: str):
    if name not in registry:
        raise ValueError(f"{flag}: unknown parser {name!r}; choose one of "
                         f"{', '.join(sorted(registry))}")
    return registry[name]


def get_tool_parser(name: str) -> type[ToolParser]:
    """The class --tool-call-parser NAME selects."""
    return _lookup(TOOL_PARSERS, name, "--tool-call-parser")


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The class --reasoning-parser NAME selects."""
    return _lookup(REASONING_PARSERS, name, "--reasoning-parser")


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "DeepSeekR1ReasoningParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedToolCallParser",
    "ParsedMessage",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningStream",
    "RequiredToolCallsParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStream",
    "get_reasoning_parser",
    "get_tool_parser",
    "tool_choice_json_schema",
]
