"""What the EngineCore does for structured outputs each step (docs/ARCHITECTURE.md, Structured
outputs): start compiles, notice finished and failed ones, advance matchers with the sampled
tokens, and fill the token bitmask of a step once the tokens before it are in.
"""

import concurrent.futures
import os
import time
from collections.abc import Callable

import numpy as np
import xgrammar

from echo.core.request import Request
from echo.core.sched_output import GrammarBitmask
from echo.core.step_results import EngineCoreOutput
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.request_grammar import RequestGrammar

# a grammar not compiled by then fails its request; its thread runs on (a compile cannot be
# interrupted), which is why distinct compiles at once are bounded too
COMPILE_TIMEOUT_S = 10.0
MAX_COMPILING = 32
# rows per batch fill above which xgrammar's threads help more than they cost
_THREADED_FILL_ROWS = 16
# requests per step above which their accepts run on threads: xgrammar releases the GIL inside
# accept_token, the costly part (tens of µs a token for a JSON schema), so K threads advance K
# matchers at once (tools/dev/probe_grammar_step.py; docs/benchmarks.md, Structured outputs)
_THREADED_ACCEPT_ROWS = 16


def default_accept_threads() -> int:
    """Half the CPUs this process may run on, at most 8 (the workers and xgrammar's fill
    threads need the rest); 1, no threads, on a small machine."""
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...], max_num_seqs: int,
                 accept_threads: int | None = None):
        self.compiler = GrammarCompilerPool(load_tokenizer, vocab_size, stop_token_ids)
        self.num_words = -(-vocab_size // 32)
        self.grammars: dict[str, RequestGrammar] = {}  # every unfinished structured request
        self.compiling: dict[str, RequestGrammar] = {}  # those whose grammar is not resolved
        self._rows = np.zeros((max_num_seqs, self.num_words), dtype=np.int32)
        self._batch = xgrammar.BatchGrammarMatcher()
        self._accept_threads = accept_threads or default_accept_threads()
        self._accept_pool = (concurrent.futures.ThreadPoolExecutor(
            self._accept_threads, thread_name_prefix="echo-grammar-accept")
            if self._accept_threads > 1 else None)
        # cumulative, for SchedulerStats: host seconds in accept and bitmask, bitmasks filled
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
        start = time.perf_counter()
        grammars = self.grammars
        work = [(output, grammar) for output in outputs
                if (grammar := grammars.get(output.request_id)) is not None]
        refused = []
        for (output, _), accepted in zip(work, self._advance(work)):
            if not accepted:
                refused.append((output.request_id, "structured_outputs: the grammar refused "
                                f"sampled token {output.new_token_ids}"))
            if output.finish_reason is not None:
                del grammars[output.request_id]
        self.accept_seconds += time.perf_counter() - start
        return refused

    def _advance(self, work: list[tuple[EngineCoreOutput, RequestGrammar]]) -> list[bool]:
        """Each grammar past its output's tokens, on the accept threads when there are many
        (each grammar is touched by one thread only)."""
        def advance(part):
            return [not output.new_token_ids or grammar.accept(output.new_token_ids)
                    for output, grammar in part]

        if self._accept_pool is None or len(work) < _THREADED_ACCEPT_ROWS:
            return advance(work)
        size = -(-len(work) // self._accept_threads)
        parts = [work[i:i + size] for i in range(0, len(work), size)]
        return [ok for done in self._accept_pool.map(advance, parts) for ok in done]

    def bitmask(self, step_id: int, request_ids: list[str],
                drafts: dict[str, list[int]] | None = None) -> GrammarBitmask:
        """The step's bitmask for the requests that sample in it, filled from matchers that
        have accepted every token before the step: a row per request, or with drafts
        (speculative decoding) one per draft and one after (RequestGrammar.fill_rows)."""
        start = time.perf_counter()
        mask = self._fill(step_id, request_ids, drafts or {})
        self.fill_seconds += time.perf_counter() - start
        self.bitmask_steps += 1
        return mask

    def _fill(self, step_id: int, request_ids: list[str],
              drafts: dict[str, list[int]]) -> GrammarBitmask:
        grammars = [(rid, self.grammars.get(rid)) for rid in request_ids]
        rows = [(rid, g) for rid, g in grammars if g is not None and g.ready
                and (g.constrains or rid in drafts)]
        if not rows:
            return GrammarBitmask(step_id, num_words=self.num_words)
        if any(rid in drafts for rid, _ in rows):
            return self._draft_bitmask(step_id, rows, drafts)
        count = len(rows)
        matchers = [g.matcher for _, g in rows]
        if count >= _THREADED_FILL_ROWS:
            self._batch.batch_fill_next_token_bitmask(matchers, self._rows)
        else:
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(self._rows, i)
        for i, (_, g) in enumerate(rows):
            g.finish_row(self._rows[i])
        return GrammarBitmask(step_id, [rid for rid, _ in rows], self.num_words,
                              self._rows[:count].tobytes())

    def _draft_bitmask(self, step_id: int, rows: list[tuple[str, RequestGrammar]],
                       drafts: dict[str, list[int]]) -> GrammarBitmask:
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
        if self._accept_pool is not None:
            self._accept_pool.shutdown(wait=False)
