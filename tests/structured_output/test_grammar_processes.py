"""GrammarProcessPool: rows filled in the processes equal a fresh xgrammar matcher's mask,
requests spread over the processes and a process keeps a grammar only while a request of
its uses it, a dead process is an error naming it, and shutdown leaves no process and no
shared-memory segment behind."""

import os
import signal

import numpy as np
import pytest

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.grammar_processes import GrammarProcessPool
from echo.structured_output.grammar_table import GrammarWork
from tests.structured_output.reference import fresh_mask

REGEX = r"[a-z]{1,40}"


@pytest.fixture(scope="module")
def compiled(tokenizer):
    pool = GrammarCompilerPool(lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    try:
        params = StructuredOutputsParams(regex=REGEX)
        yield params, pool.submit(params).result()
    finally:
        pool.shutdown()


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_rows_grammars_and_shutdown(tokenizer, compiled):
    params, grammar = compiled
    num_words = -(-len(tokenizer) // 32)
    word = tokenizer.encode("hellozebralamp", add_special_tokens=False)
    pool = GrammarProcessPool(2, num_rows=4, num_words=num_words)
    try:
        for rid in ("a", "b", "c"):
            pool.add(rid, grammar, params, "closed")
        assert pool.load() == [(2, 1), (1, 1)]  # the fewest requests first
        done = pool.run([GrammarWork("a", word[:2], row=0), GrammarWork("b", [], row=1),
                         GrammarWork("c", word[:1], row=2)])
        assert done.refused == [] and done.filled == [0, 1, 2]
        for row, tokens in zip(pool.rows[:3], (word[:2], [], word[:1])):
            np.testing.assert_array_equal(row, fresh_mask(grammar, tokens, num_words))
        # "a" forgotten, "c" finished: process 0 holds nothing, so it drops the grammar, and
        # a later request there gets it sent again
        pool.forget(["a"])
        done = pool.run([GrammarWork("c", word[1:2], finished=True)])
        assert pool.load() == [(0, 0), (1, 1)]
        pool.add("d", grammar, params, "closed")
        assert pool.load() == [(1, 1), (1, 1)]
        done = pool.run([GrammarWork("d", word[:3], row=3), GrammarWork("b", [4], row=0)])
        assert done.refused == [1] and done.filled == [0]  # token 4 is <reponame>: no letter
        np.testing.assert_array_equal(pool.rows[3], fresh_mask(grammar, word[:3], num_words))
        pids, segment = pool.pids(), pool._shm.name
    finally:
        pool.shutdown()
    assert all(gone(pid) for pid in pids)
    assert not os.path.exists(f"/dev/shm/{segment}")


def test_a_dead_grammar_process_is_an_error_naming_it(tokenizer, compiled):
    params, grammar = compiled
    pool = GrammarProcessPool(1, num_rows=1, num_words=-(-len(tokenizer) // 32))
    try:
        pool.add("a", grammar, params, "closed")
        pool.run([GrammarWork("a", [], row=0)])
        os.kill(pool.pids()[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"grammar process echo-grammar-0 .* died"):
            pool.run([GrammarWork("a", [], row=0)])
    finally:
        pool.shutdown()


def test_a_step_interrupted_while_it_waits_leaves_the_books_in_step(tokenizer, compiled,
                                                                     monkeypatch):
    """Ctrl-C while the core waits for replies (the LLM then aborts every request and goes
    on): the next step reads the stale reply first, and a request that finished in the
    interrupted step is not forgotten twice (which the process would not survive)."""
    params, grammar = compiled
    num_words = -(-len(tokenizer) // 32)
    word = tokenizer.encode("hellozebralamp", add_special_tokens=False)
    pool = GrammarProcessPool(1, num_rows=2, num_words=num_words)
    try:
        pool.add("a", grammar, params, "closed")
        pool.add("b", grammar, params, "closed")

        def interrupted(p):
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(pool, "_receive", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pool.run([GrammarWork("a", word[:1], row=0),
                          GrammarWork("b", [4], finished=True)])
        pool.forget(["a", "b"])  # what the LLM does after the interrupt
        assert pool.load() == [(0, 0)]
        pool.add("c", grammar, params, "closed")
        done = pool.run([GrammarWork("c", word[:2], row=1)])
        assert done.refused == [] and done.filled == [0]
        np.testing.assert_array_equal(pool.rows[1], fresh_mask(grammar, word[:2], num_words))
        assert all(p.process.poll() is None for p in pool._processes)
    finally:
        pool.shutdown()


def test_a_grammar_the_process_cannot_load_fails_only_its_request(tokenizer, compiled,
                                                                  monkeypatch):
    params, grammar = compiled
    num_words = -(-len(tokenizer) // 32)
    pool = GrammarProcessPool(1, num_rows=2, num_words=num_words)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(pool, "_serialize", lambda key, compiled: "{not json")
            pool.add("bad", grammar, params, "closed")
        other = StructuredOutputsParams(regex=REGEX + "x")  # another key: sent whole
        pool.add("good", grammar, other, "closed")
        done = pool.run([GrammarWork("bad", [], row=0), GrammarWork("good", [], row=1)])
        assert done.filled == [1] and done.refused == []
        [(index, error)] = done.failed
        assert index == 0 and "could not load the grammar" in error
        np.testing.assert_array_equal(pool.rows[1], fresh_mask(grammar, [], num_words))
        pool.forget(["bad", "good"])
        assert pool.load() == [(0, 0)]
        pool.add("later", grammar, other, "closed")  # the process took the forget in stride
        assert pool.run([GrammarWork("later", [], row=0)]).filled == [0]
    finally:
        pool.shutdown()
