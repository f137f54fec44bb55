"""One request's grammar state: its compiled grammar (once ready) and the matcher that follows
its accepted tokens, with the reasoning gate in front.

A reasoning model thinks freely first: while the request is inside its reasoning (the opening
token seen, the closing one not yet), its tokens are unconstrained and the matcher does not see
them; the grammar applies from the token after the closing one.
"""

import time
from collections import deque
from concurrent.futures import Future

import numpy as np
import xgrammar

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.grammar_spec import limits_whitespace
from echo.structured_output.whitespace import WhitespaceTokens

# accepted tokens whose whitespace runs a rollback can restore (speculative decoding rolls back
# at most a step's drafts; fill_rows, its drafts)
_RUN_HISTORY = 64


def prompt_reasoning(prompt_token_ids: list[int], start_id: int, end_id: int) -> str:
    """Where the prompt leaves the model's reasoning: "open" (DeepSeek-R1's template ends the
    prompt with the opening tag), "closed" (a Qwen3 prompt with thinking off holds an empty
    pair) or "none" (neither tag: the model opens it itself if it reasons at all)."""
    for token in reversed(prompt_token_ids):
        if token == end_id:
            return "closed"
        if token == start_id:
            return "open"
    return "none"


def request_reasoning(params: StructuredOutputsParams, prompt_token_ids: list[int]) -> str:
    """prompt_reasoning for a request's prompt; "closed" when the request names no tags."""
    tags = params.reasoning_token_ids
    return prompt_reasoning(prompt_token_ids, *tags) if tags else "closed"


class CompilingGrammar:
    """A request's grammar as the core sees it while it compiles: ready once the compiled
    grammar is there (the scheduler admits the request only then); error: why it never
    will be."""

    def __init__(self, future: Future, params: StructuredOutputsParams, reasoning_state: str):
        """reasoning_state: where the prompt leaves the reasoning (request_reasoning)."""
        self.future = future
        self.params = params
        self.reasoning_state = reasoning_state
        self.submitted = time.monotonic()
        self.ready = False
        self.error: str | None = None

    def resolve(self, whitespace: WhitespaceTokens | None = None) -> bool:
        """Take the compiled grammar if it is there (True once resolved, ready or not);
        whitespace: the vocabulary's whitespace tokens, for a JSON grammar's bound."""
        if self.ready or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self._take(self.future.result(), whitespace)
            self.ready = True
        except Exception as e:  # the compile's error, for the request that asked for it
            self.error = str(e) or type(e).__name__
        return True

    def _take(self, compiled: xgrammar.CompiledGrammar,
              whitespace: WhitespaceTokens | None) -> None:
        """What a compiled grammar sets up (nothing here: the matcher lives elsewhere)."""


class RequestGrammar(CompilingGrammar):
    """The grammar with its matcher: what advances with the request's tokens."""

    def __init__(self, future: Future, params: StructuredOutputsParams, reasoning_state: str):
        super().__init__(future, params, reasoning_state)
        self.matcher: xgrammar.GrammarMatcher | None = None
        tags = params.reasoning_token_ids
        self.start_id, self._end_id = tags if tags else (-1, -1)
        self.reasoning = reasoning_state == "open"
        # a prompt with neither tag: the model may still open its reasoning itself, so its
        # first token may be the opening tag as well as what the grammar allows
        self.may_open = reasoning_state == "none"
        self.num_accepted = 0  # tokens the matcher holds: what rollback can undo
        self._bounds_whitespace = limits_whitespace(params)
        self._whitespace: WhitespaceTokens | None = None  # set by resolve, for JSON
        self.whitespace_run = 0  # whitespace characters in a row through whitespace tokens
        self._runs: deque[int] = deque(maxlen=_RUN_HISTORY)  # the run before each token

    def _take(self, compiled: xgrammar.CompiledGrammar,
              whitespace: WhitespaceTokens | None) -> None:
        self.matcher = xgrammar.GrammarMatcher(compiled)
        if self._bounds_whitespace:
            self._whitespace = whitespace

    @property
    def constrains(self) -> bool:
        """Whether its next token is constrained: ready, past its reasoning, not finished."""
        return self.ready and not self.reasoning and not self.matcher.is_terminated()

    def accept(self, token_ids: list[int]) -> bool:
        """Advance past sampled tokens; False if the grammar refuses one (then the request
        cannot go on within its grammar)."""
        for token in token_ids:
            if self.may_open:
                self.may_open = False
                if token == self.start_id:
                    self.reasoning = True
                    continue
            if self.reasoning:
                self.reasoning = token != self._end_id
                continue
            if self.matcher.is_terminated():
                return True  # a token past the stop token: the scheduler drops it
            if not self.matcher.accept_token(token):
                return False
            self.num_accepted += 1
            if self._whitespace is not None:
                self._runs.append(self.whitespace_run)
                self.whitespace_run = self._whitespace.run_after(self.whitespace_run, token)
        return True

    def finish_row(self, row: np.ndarray) -> None:
        """What the request adds to its filled mask row: the reasoning tag while it may still
        open, the bound on a JSON constraint's whitespace (whitespace.py)."""
        self.allow_opening_tag(row)
        if self._whitespace is not None:
            self._whitespace.limit(row, self.whitespace_run)

    def allow_opening_tag(self, row: np.ndarray) -> None:
        """Set the reasoning tag's bit in a filled mask row while the request's first token may
        still open its reasoning."""
        if self.may_open:
            row.view(np.uint32)[self.start_id // 32] |= np.uint32(1 << self.start_id % 32)

    def fill_rows(self, rows: np.ndarray, drafts: list[int]) -> bool:
        """Fill rows[0 .. len(drafts)] with the tokens allowed at the request's next token and
        after each of its drafts (speculative decoding: row j as if drafts[:j] were accepted;
        an unconstrained row allows every token), then put the state back. Rows past a draft
        the grammar refuses stay all allowed: that draft's own row refuses it, so nothing
        after it is emitted. True when some row constrains."""
        state = self.reasoning, self.may_open, self.num_accepted
        constrained = False
        rows[:len(drafts) + 1] = -1
        for j in range(len(drafts) + 1):
            if self.constrains:
                self.matcher.fill_next_token_bitmask(rows, j)
                constrained = True
                self.finish_row(rows[j])
            if j == len(drafts) or not self.accept(drafts[j:j + 1]):
                break
        self.rollback(self.num_accepted - state[2])
        self.reasoning, self.may_open = state[0], state[1]
        return constrained

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens the matcher accepted (rejected draft tokens)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"can roll back at most {self.num_accepted} tokens, "
                             f"asked {num_tokens}")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            if self._whitespace is not None:
                for _ in range(num_tokens):  # history lost past _RUN_HISTORY: start over
                    self.whitespace_run = self._runs.pop() if self._runs else 0
