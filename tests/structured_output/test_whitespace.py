"""The bound on a JSON constraint's free whitespace, on the mask: which tokens are whitespace,
when a row loses them, and a request's run through accepts, rollbacks and drafts, against
xgrammar's own masks."""

import numpy as np
import pytest

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.grammar_spec import MAX_JSON_WHITESPACE
from echo.structured_output.request_grammar import RequestGrammar, request_reasoning
from echo.structured_output.whitespace import WhitespaceTokens


def allowed(row: np.ndarray) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_whitespace_tokens_of_a_hand_vocabulary():
    vocab = [b" ", b"a", b"\n\n", b" a", b"", b"\t \r", b"{"]
    ws = WhitespaceTokens.from_vocab(vocab, 40)  # 33 ids of LM-head padding past the vocab
    assert ws.chars == {0: 1, 2: 2, 5: 3}
    assert [ws.run_after(4, t) for t in (0, 1, 2, 39)] == [5, 0, 6, 0]
    row = np.full(2, -1, dtype=np.int32)
    ws.limit(row, MAX_JSON_WHITESPACE - 1)  # below the bound: untouched
    assert allowed(row) == set(range(64))
    ws.limit(row, MAX_JSON_WHITESPACE)
    assert allowed(row) == set(range(64)) - {0, 2, 5}
    only_whitespace = np.zeros(2, dtype=np.int32)
    only_whitespace[0] = (1 << 0) | (1 << 2)
    ws.limit(only_whitespace, 10 * MAX_JSON_WHITESPACE)  # nothing else allowed: kept
    assert allowed(only_whitespace) == {0, 2}


@pytest.fixture(scope="module")
def pool(tokenizer):
    pool = GrammarCompilerPool(lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    yield pool
    pool.shutdown()


def grammar_of(pool, **constraint) -> RequestGrammar:
    params = StructuredOutputsParams(**constraint)
    future = pool.submit(params)
    future.result()
    grammar = RequestGrammar(future, params, request_reasoning(params, [1, 2]))
    assert grammar.resolve(pool.whitespace) and grammar.ready
    return grammar


def row_of(grammar: RequestGrammar, num_words: int) -> np.ndarray:
    row = np.zeros((1, num_words), dtype=np.int32)
    grammar.matcher.fill_next_token_bitmask(row, 0)
    grammar.finish_row(row[0])
    return row[0]


def test_a_json_request_loses_whitespace_tokens_past_the_bound(tokenizer, pool):
    num_words = -(-len(tokenizer) // 32)
    grammar = grammar_of(pool, json={"type": "object"})
    space, newline = (tokenizer.encode(t, add_special_tokens=False) for t in (" ", "\n"))
    assert len(space) == len(newline) == 1
    space, newline = space[0], newline[0]
    assert grammar.accept(tokenizer.encode("{", add_special_tokens=False))
    free = allowed(row_of(grammar, num_words))
    assert {space, newline} <= free  # xgrammar's grammar allows whitespace here ...
    for _ in range(MAX_JSON_WHITESPACE - 1):
        assert grammar.accept([space])
    assert allowed(row_of(grammar, num_words)) == free  # ... up to the bound
    assert grammar.accept([newline])
    bounded = allowed(row_of(grammar, num_words))
    whitespace = {t for t in free if tokenizer.decode([t]).strip(" \t\n\r") == ""
                  and tokenizer.decode([t])}
    assert space in whitespace and bounded == free - whitespace and '"' in {
        tokenizer.decode([t]) for t in bounded}
    # a rejected draft's rollback puts the run back; a key starts the count again
    assert grammar.accept([space]) and grammar.whitespace_run == MAX_JSON_WHITESPACE + 1
    grammar.rollback(2)
    assert grammar.whitespace_run == MAX_JSON_WHITESPACE - 1
    assert allowed(row_of(grammar, num_words)) == free
    assert grammar.accept([newline]) and grammar.accept(
        tokenizer.encode('"a"', add_special_tokens=False))
    assert grammar.whitespace_run == 0


def test_draft_rows_and_other_constraints(tokenizer, pool):
    num_words = -(-len(tokenizer) // 32)
    space = tokenizer.encode(" ", add_special_tokens=False)[0]
    grammar = grammar_of(pool, json={"type": "object"})
    assert grammar.accept(tokenizer.encode("{", add_special_tokens=False))
    assert grammar.accept([space] * (MAX_JSON_WHITESPACE - 1))
    rows = np.zeros((3, num_words), dtype=np.int32)
    assert grammar.fill_rows(rows, [space, space])
    assert space in allowed(rows[0]) and space not in allowed(rows[1])
    assert space not in allowed(rows[2])
    assert grammar.whitespace_run == MAX_JSON_WHITESPACE - 1  # fill_rows put it back
    # a regex, and JSON without free whitespace, are the user's to bound
    for constraint in ({"regex": " {0,100}x"},
                       {"json": {"type": "object"}, "disable_any_whitespace": True}):
        other = grammar_of(pool, **constraint)
        if "regex" in constraint:
            assert other.accept([space] * 2 * MAX_JSON_WHITESPACE)
            assert space in allowed(row_of(other, num_words))
        assert other.whitespace_run == 0
