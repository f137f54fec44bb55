"""The matchers of a set of structured requests, and one step's grammar work on them: advance
each request past the tokens it sampled in the step that landed, then fill its rows of the next
step's token bitmask. The core runs one table in its busy loop, or one in each grammar process
(grammar_processes.py); the work and its result are msgspec structs so they can travel.
"""

import time

import msgspec
import numpy as np

from echo.structured_output.request_grammar import RequestGrammar


class GrammarWork(msgspec.Struct, array_like=True, gc=False):
    """One request's part of a step's work."""

    request_id: str
    tokens: list[int]  # sampled in the step that landed; [] if none
    row: int = -1  # its first row in the step's table; -1: it has none
    # speculative decoding: rows row .. row + len(drafts), one per draft and one after
    # (RequestGrammar.fill_rows); None: one row
    drafts: list[int] | None = None
    finished: bool = False  # the request ended with the step that landed: forget it


class WorkDone(msgspec.Struct, array_like=True, gc=False):
    """What came of a work list: indices into it, and host seconds spent."""

    refused: list[int]  # whose tokens the grammar refused
    filled: list[int]  # whose rows constrain (the others allow everything)
    failed: list[tuple[int, str]] = []  # whose grammar could not be set up here, and why
    accept_seconds: float = 0.0
    fill_seconds: float = 0.0


class GrammarTable:
    def __init__(self):
        self.grammars: dict[str, RequestGrammar] = {}  # ready ones, by request id

    def run(self, work: list[GrammarWork], rows: np.ndarray) -> WorkDone:
        """Do the work in order, one request after another, filling rows in place."""
        done = WorkDone([], [])
        grammars = self.grammars
        for i, w in enumerate(work):
            grammar = grammars[w.request_id]
            if grammar.error is not None:
                done.failed.append((i, grammar.error))
                continue
            start = time.perf_counter()
            accepted = not w.tokens or grammar.accept(w.tokens)
            done.accept_seconds += time.perf_counter() - start
            if not accepted:
                done.refused.append(i)
            if w.finished:
                del grammars[w.request_id]
            elif accepted and w.row >= 0:
                start = time.perf_counter()
                if self._fill(grammar, w, rows):
                    done.filled.append(i)
                done.fill_seconds += time.perf_counter() - start
        return done

    @staticmethod
    def _fill(grammar: RequestGrammar, w: GrammarWork, rows: np.ndarray) -> bool:
        """Fill the request's rows; whether any constrains."""
        if w.drafts is not None:
            return grammar.fill_rows(rows[w.row:w.row + len(w.drafts) + 1], w.drafts)
        if not grammar.constrains:
            return False
        grammar.matcher.fill_next_token_bitmask(rows, w.row)
        grammar.finish_row(rows[w.row])
        return True
