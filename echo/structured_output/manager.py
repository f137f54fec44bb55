"""What the EngineCore does for structured outputs each step (docs/ARCHITECTURE.md, Structured
outputs): start compiles, notice finished and failed ones, advance matchers with the sampled
tokens, and fill the token bitmask of a step once the tokens before it are in.
"""

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from echo.core.request import Request
from echo.core.sched_output import GrammarBitmask
from echo.core.step_results import EngineCoreOutput
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.request_grammar import RequestGrammar

# a grammar not compiled by then fails its request; its thread runs on (a compile cannot be
# interrupted), which is why distinct compiles at once are bounded too
COMPILE_TIMEOUT_S = 10.0
MAX_COMPILING = 32
# NOTE: the grammar work runs in the busy loop's thread, one request after another. xgrammar
# releases the GIL inside accept_token and fill_next_token_bitmask, but threads did not pay: every
# return from those calls queues for the GIL behind whatever Python the other threads run, and
# on the H200 machine 4 threads filled 64 JSON rows in 1.2 ms a step where one did it in
# 0.5 ms, for 0.2-0.9 ms saved on the accepts, and lost 3 of 4 paired runs (docs/benchmarks.md,
# Structured outputs).


@dataclass(slots=True)
class _RequestWork:
    """One request's part of a step's grammar work: the tokens it sampled in the step that
    landed (empty if none), then its row of the next step's mask (-1: it has none)."""
    request_id: str
    grammar: RequestGrammar
    tokens: list[int]
    row: int
    accepted: bool = True
    filled: bool = False

    def run(self, rows: np.ndarray) -> tuple[float, float]:
        """Accept, then fill the row if the request still constrains; seconds of each."""
        start = time.perf_counter()
        if self.tokens:
            self.accepted = self.grammar.accept(self.tokens)
        accepted = time.perf_counter()
        if not (self.row >= 0 and self.accepted and self.grammar.constrains):
            return accepted - start, 0.0
        self.grammar.matcher.fill_next_token_bitmask(rows, self.row)
        self.grammar.finish_row(rows[self.row])
        self.filled = True
        return accepted - start, time.perf_counter() - accepted


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...], max_num_seqs: int):
        self.compiler = GrammarCompilerPool(load_tokenizer, vocab_size, stop_token_ids)
        self.num_words = -(-vocab_size // 32)
        self.grammars: dict[str, RequestGrammar] = {}  # every unfinished structured request
        self.compiling: dict[str, RequestGrammar] = {}  # those whose grammar is not resolved
        self._rows = np.zeros((max_num_seqs, self.num_words), dtype=np.int32)
        # cumulative, for SchedulerStats: host seconds advancing matchers and filling masks,
        # and bitmasks filled
        self.accept_seconds = 0.0
        self.fill_seconds = 0.0
        self.bitmask_steps = 0

    # ---- requests -------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Start compiling the request's grammar; ValueError when too many compile at once."""
        params = request.sampling_params.structured_outputs
        if self.compiler.num_compiling() >= MAX_COMPILING:
            raise ValueError(f"structured_outputs: {MAX_COMPILING} grammars are compiling "
                             "already; retry shortly")
        grammar = RequestGrammar(self.compiler.submit(params), params, request.prompt_token_ids)
        request.grammar = grammar
        self.grammars[request.request_id] = grammar
        self.compiling[request.request_id] = grammar

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.grammars.pop(rid, None)
            self.compiling.pop(rid, None)

    def poll(self) -> list[tuple[str, str]]:
        """Resolve finished compiles; (request id, error) for each that failed or timed out."""
        failed = []
        now = time.monotonic()
        for rid, grammar in list(self.compiling.items()):
            if grammar.resolve(self.compiler.whitespace):
                del self.compiling[rid]
                if grammar.error is not None:
                    failed.append((rid, f"structured_outputs: {grammar.error}"))
            elif now - grammar.submitted > COMPILE_TIMEOUT_S:
                del self.compiling[rid]
                failed.append((rid, f"structured_outputs: the grammar did not compile within "
                                    f"{COMPILE_TIMEOUT_S:.0f} s; simplify it"))
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to timeout for a compile to finish (an engine with nothing else to do)."""
        concurrent.futures.wait([g.future for g in self.compiling.values()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- steps ----------------------------------------------------------------------------

    def accept(self, outputs: list[EngineCoreOutput]) -> list[tuple[str, str]]:
        """Advance matchers past the step's tokens and forget finished requests; (request id,
        error) for each whose token the grammar refused."""
        return self.accept_and_fill(outputs)[0]

    def bitmask(self, step_id: int, request_ids: list[str],
                drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        """The step's bitmask for the requests that sample in it, filled from matchers that
        have accepted every token before the step: a row per request, or with drafts
        (speculative decoding) one per draft and one after (RequestGrammar.fill_rows)."""
        return self.accept_and_fill([], step_id, request_ids, drafts)[1]

    def accept_and_fill(self, outputs: list[EngineCoreOutput], step_id: int | None = None,
                        request_ids: list[str] = (), drafts: dict[str, list[int]] | None = None
                        ) -> tuple[list[tuple[str, str]], GrammarBitmask | None]:
        """accept(outputs), then bitmask(step_id, request_ids, drafts) if a step is given, in
        one pass over the requests: each advanced, then its row filled."""
        grammars = self.grammars
        tokens = {o.request_id: o.new_token_ids for o in outputs if o.request_id in grammars}
        finished = {o.request_id for o in outputs
                    if o.finish_reason is not None and o.request_id in grammars}
        drafted = step_id is not None and any(rid in (drafts or ()) for rid in request_ids)
        # the rows of a step without drafts are filled in the same pass; a request that has
        # just finished has none (async scheduling put it in the step before it knew)
        rows = [] if step_id is None or drafted else [
            rid for rid in request_ids if rid not in finished
            and (g := grammars.get(rid)) is not None and g.ready]
        work = [_RequestWork(rid, grammars[rid], tokens.get(rid, []), row)
                for row, rid in enumerate(rows)]
        in_rows = set(rows)
        work += [_RequestWork(rid, grammars[rid], toks, -1)
                 for rid, toks in tokens.items() if rid not in in_rows]
        for w in work:
            accept_s, fill_s = w.run(self._rows)
            self.accept_seconds += accept_s
            self.fill_seconds += fill_s
        refused = [(w.request_id, "structured_outputs: the grammar refused sampled token "
                    f"{w.tokens}") for w in work if not w.accepted]
        for rid in finished:
            del grammars[rid]
        if step_id is None:
            return refused, None
        packing = time.perf_counter()
        mask = (self._draft_bitmask(step_id, request_ids, drafts) if drafted
                else self._pack(step_id, [w for w in work if w.filled]))
        self.bitmask_steps += 1
        self.fill_seconds += time.perf_counter() - packing
        return refused, mask

    def _pack(self, step_id: int, filled: list[_RequestWork]) -> GrammarBitmask:
        """The filled rows in request order, as the message's bytes (one copy)."""
        if not filled:
            return GrammarBitmask(step_id, num_words=self.num_words)
        count = len(filled)
        if filled[-1].row == count - 1:  # every row filled: they are the first `count`
            data = self._rows[:count].tobytes()
        else:
            data = self._rows[[w.row for w in filled]].tobytes()
        return GrammarBitmask(step_id, [w.request_id for w in filled], self.num_words, data)

    def _draft_bitmask(self, step_id: int, request_ids: list[str],
                       drafts: dict[str, list[int]]) -> GrammarBitmask:
        """Rows for each draft and one after, one request after another (a drafting engine
        keeps one step in flight, so this mask is filled at launch, with no accept before)."""
        grammars = [(rid, self.grammars.get(rid)) for rid in request_ids]
        rows = [(rid, g) for rid, g in grammars if g is not None and g.ready
                and (g.constrains or rid in drafts)]
        counts = [len(drafts.get(rid, ())) + 1 for rid, _ in rows]
        table = np.empty((sum(counts), self.num_words), dtype=np.int32)
        kept, kept_counts, at = [], [], 0
        for (rid, grammar), count in zip(rows, counts):
            if grammar.fill_rows(table[at:at + count], drafts.get(rid, [])):
                kept.append(rid)
                kept_counts.append(count)
                at += count  # a request no row of which constrains is left out
        return GrammarBitmask(step_id, kept, self.num_words, table[:at].tobytes(), kept_counts)

    def shutdown(self) -> None:
        self.compiler.shutdown()
