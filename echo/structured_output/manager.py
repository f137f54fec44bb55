"""What the EngineCore does for structured outputs each step (docs/ARCHITECTURE.md, Structured
outputs): start compiles, notice finished and failed ones, advance matchers with the sampled
tokens, and fill the token bitmask of a step once the tokens before it are in.
"""

import concurrent.futures
import time
from collections.abc import Callable

import numpy as np

from echo.core.request import Request
from echo.core.sched_output import GrammarBitmask
from echo.core.step_results import EngineCoreOutput
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.grammar_processes import GrammarProcessPool
from echo.structured_output.grammar_table import GrammarTable, GrammarWork
from echo.structured_output.request_grammar import (
    CompilingGrammar,
    RequestGrammar,
    request_reasoning,
)

# a grammar not compiled by then fails its request; its thread runs on (a compile cannot be
# interrupted), which is why distinct compiles at once are bounded too
COMPILE_TIMEOUT_S = 10.0
MAX_COMPILING = 32
# NOTE: without grammar processes the grammar work runs in the busy loop's thread, one request
# after another. xgrammar releases the GIL inside accept_token and fill_next_token_bitmask, but
# threads did not pay: every return from those calls queues for the GIL behind whatever Python
# the other threads run, and on the H200 machine 4 threads filled 64 JSON rows in 1.2 ms a step
# where one did it in 0.5 ms (docs/benchmarks.md, Structured outputs). Processes have a GIL
# each.


class StructuredOutputManager:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...], max_num_seqs: int, rows_per_seq: int = 1,
                 num_processes: int = 0):
        """rows_per_seq: mask rows a request may need in a step (1 + its drafts);
        num_processes: grammar processes to shard the matchers over (grammar_processes.py),
        started with the first structured request; 0: the busy loop does the work."""
        self.compiler = GrammarCompilerPool(load_tokenizer, vocab_size, stop_token_ids)
        self.num_words = -(-vocab_size // 32)
        self.grammars: dict[str, CompilingGrammar] = {}  # every unfinished structured request
        self.compiling: dict[str, CompilingGrammar] = {}  # those whose grammar is not resolved
        self._num_rows = max_num_seqs * rows_per_seq
        self._num_processes = num_processes
        self._pool: GrammarProcessPool | None = None
        self._shut_down = False
        self._table = GrammarTable()  # the busy loop's matchers, without processes
        self._rows = (np.zeros((self._num_rows, self.num_words), dtype=np.int32)
                      if num_processes == 0 else None)
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
        if self._shut_down:
            raise ValueError("structured_outputs: the engine is shut down")
        if self._num_processes and self._pool is None:
            self._pool = GrammarProcessPool(self._num_processes, self._num_rows, self.num_words)
        kind = CompilingGrammar if self._pool is not None else RequestGrammar
        grammar = kind(self.compiler.submit(params), params,
                       request_reasoning(params, request.prompt_token_ids))
        request.grammar = grammar
        self.grammars[request.request_id] = grammar
        self.compiling[request.request_id] = grammar

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self.grammars.pop(rid, None)
            self.compiling.pop(rid, None)
            self._table.grammars.pop(rid, None)
        if self._pool is not None:
            self._pool.forget(request_ids)

    def poll(self) -> list[tuple[str, str]]:
        """Resolve finished compiles; (request id, error) for each that failed or timed out."""
        failed = []
        now = time.monotonic()
        for rid, grammar in list(self.compiling.items()):
            if grammar.resolve(self.compiler.whitespace):
                del self.compiling[rid]
                if grammar.error is not None:
                    failed.append((rid, f"structured_outputs: {grammar.error}"))
                elif self._pool is not None:
                    self._pool.add(rid, grammar.future.result(), grammar.params,
                                   grammar.reasoning_state)
                else:
                    self._table.grammars[rid] = grammar
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
        one pass over the requests: each advanced, then its rows filled."""
        grammars = self.grammars
        tokens = {o.request_id: o.new_token_ids for o in outputs
                  if (g := grammars.get(o.request_id)) is not None and g.ready}
        finished = {o.request_id for o in outputs
                    if o.finish_reason is not None and o.request_id in tokens}
        work = self._step_rows(step_id, request_ids, drafts, tokens, finished)
        in_rows = {w.request_id for w in work}
        work += [GrammarWork(rid, toks, finished=rid in finished)
                 for rid, toks in tokens.items() if rid not in in_rows]
        if self._pool is not None:
            done, rows = self._pool.run(work), self._pool.rows
        else:
            done, rows = self._table.run(work, self._rows), self._rows
        self.accept_seconds += done.accept_seconds
        self.fill_seconds += done.fill_seconds
        refused = [(work[i].request_id, "structured_outputs: the grammar refused sampled token "
                    f"{work[i].tokens}") for i in done.refused]
        refused += [(work[i].request_id, f"structured_outputs: {error}")
                    for i, error in done.failed]
        for rid in finished:
            del grammars[rid]
        if step_id is None:
            return refused, None
        packing = time.perf_counter()
        mask = self._pack(step_id, [work[i] for i in done.filled], rows)
        self.bitmask_steps += 1
        self.fill_seconds += time.perf_counter() - packing
        return refused, mask

    def _step_rows(self, step_id: int | None, request_ids: list[str],
                   drafts: dict[str, list[int]] | None, tokens: dict[str, list[int]],
                   finished: set[str]) -> list[GrammarWork]:
        """The work of the requests that sample in the step, with their rows: one each, or
        with drafts (speculative decoding: a drafting engine keeps one step in flight, so this
        is filled at launch) one per draft and one after. A request that has just finished has
        none (async scheduling put it in the step before it knew)."""
        if step_id is None:
            return []
        drafted = any(rid in (drafts or ()) for rid in request_ids)
        work, at = [], 0
        for rid in request_ids:
            grammar = self.grammars.get(rid)
            if rid in finished or grammar is None or not grammar.ready:
                continue
            request_drafts = drafts.get(rid, []) if drafted else None
            work.append(GrammarWork(rid, tokens.get(rid, []), at, request_drafts))
            at += 1 + len(request_drafts or ())
        if at > self._num_rows:
            raise ValueError(f"a step needs {at} mask rows, past the {self._num_rows} "
                             "allocated (max_num_seqs x rows_per_seq)")
        return work

    def _pack(self, step_id: int, filled: list[GrammarWork], rows: np.ndarray
              ) -> GrammarBitmask:
        """The filled rows in request order, as the message's bytes (one copy)."""
        if not filled:
            return GrammarBitmask(step_id, num_words=self.num_words)
        counts = [1 + len(w.drafts or ()) for w in filled]
        end = filled[-1].row + counts[-1]
        if end == sum(counts):  # every row filled: they are the first `end`
            data = rows[:end].tobytes()
        else:
            data = rows[[w.row + j for w, count in zip(filled, counts)
                         for j in range(count)]].tobytes()
        drafted = filled[0].drafts is not None
        return GrammarBitmask(step_id, [w.request_id for w in filled], self.num_words, data,
                              counts if drafted else [])

    def grammar_process_pids(self) -> list[int]:
        return self._pool.pids() if self._pool is not None else []

    def shutdown(self) -> None:
        self._shut_down = True
        self.compiler.shutdown()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
