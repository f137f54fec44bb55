"""The reasoning of thinking models (<think>...</think>) split from their answer, whole or
streamed, for vLLM's --reasoning-parser formats.

The reasoning is returned exactly as the model wrote it between the tags; the content after
</think> loses its leading whitespace (the blank lines models put after the tag). A stream
holds back what may be the start of a tag until the next chunk settles it, so its deltas add
up to split()'s result.
"""

from echo.entrypoints.parsers.tags import held_tag_start


class ReasoningParser:
    """An output is reasoning first, then content. It opens its reasoning with start_tag (after
    optional whitespace) or, where the chat template put the start tag in the prompt
    (prompt_opens_reasoning), from its first character; end_tag closes it. An output with
    neither is all content; one whose reasoning is not closed (cut off by max_tokens) is all
    reasoning."""

    start_tag = "<think>"
    end_tag = "</think>"
    prompt_opens_reasoning = False

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), None for an empty part."""
        opened = text.lstrip()
        if opened.startswith(self.start_tag):
            body = opened[len(self.start_tag):]
        elif self.prompt_opens_reasoning:
            body = text
        else:
            return None, opened or None
        reasoning, closed, content = body.partition(self.end_tag)
        return reasoning or None, (content.lstrip() or None) if closed else None

    def stream(self) -> "ReasoningStream":
        """A fresh streaming state, one per choice."""
        return ReasoningStream(self)


class ReasoningStream:
    """The streaming state of one choice."""

    def __init__(self, parser: ReasoningParser):
        self._start_tag = parser.start_tag
        self._end_tag = parser.end_tag
        self._prompt_opens_reasoning = parser.prompt_opens_reasoning
        self._mode = self._opening_mode
        self._held = ""  # the end of the last chunk, which may be the start of a tag
        self._content_started = False

    @property
    def ended(self) -> bool:
        """Whether the output is in its content phase: the end tag was seen, or the output
        did not open any reasoning."""
        return self._mode == self._content_mode

    def feed(self, text: str) -> tuple[str, str]:
        """The next text of the output -> (reasoning delta, content delta)."""
        text, self._held = self._held + text, ""
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        while pos < len(text):
            pos = self._mode(text, pos, reasoning, content)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: flush what was held back."""
        held, self._held = self._held, ""
        if self._mode == self._reasoning_mode:
            return held, ""
        if self._mode == self._opening_mode:
            # no start tag after all: as split() reads such an output
            if self._prompt_opens_reasoning:
                return held, ""
            return "", held.lstrip()
        return "", ""

    def _opening_mode(self, text: str, pos: int, reasoning: list[str],
                      content: list[str]) -> int:
        """Before the output shows whether it opens with the start tag."""
        first = pos
        while first < len(text) and text[first].isspace():
            first += 1
        if text.startswith(self._start_tag, first):
            self._mode = self._reasoning_mode
            return first + len(self._start_tag)
        if len(text) - first < len(self._start_tag) and self._start_tag.startswith(text[first:]):
            self._held = text[pos:]  # whitespace, or a part of the tag so far
            return len(text)
        if self._prompt_opens_reasoning:
            self._mode = self._reasoning_mode
            return pos
        self._mode = self._content_mode
        return first

    def _reasoning_mode(self, text: str, pos: int, reasoning: list[str],
                        content: list[str]) -> int:
        end = text.find(self._end_tag, pos)
        if end < 0:
            held = held_tag_start(text, self._end_tag, pos)
            reasoning.append(text[pos:held])
            self._held = text[held:]
            return len(text)
        reasoning.append(text[pos:end])
        self._mode = self._content_mode
        return end + len(self._end_tag)

    def _content_mode(self, text: str, pos: int, reasoning: list[str],
                      content: list[str]) -> int:
        if not self._content_started:
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if pos == len(text):
                return pos
            self._content_started = True
        content.append(text[pos:])
        return len(text)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: the model writes <think> itself when thinking is on; with thinking off (the chat
    template put an empty <think></think> in the prompt) the output is all content. Models
    whose template opens <think> in the prompt (the Qwen3 *-Thinking-2507 ones) need
    deepseek_r1 instead: a stream could not otherwise tell their reasoning from the content of
    a model that does not think until </think> or the end arrived."""


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: the chat template ends the prompt with <think>, so the output begins in its
    reasoning; a <think> the model repeats at its start is dropped."""

    prompt_opens_reasoning = True
