"""RequestGrammar's masks for speculative decoding: the row at each draft position equals the
mask of a fresh matcher that accepted the drafts before it; rows after a refused draft allow
everything; the state (matcher, reasoning gate) is as before afterwards."""

import numpy as np
import pytest

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.compiler import GrammarCompilerPool
from echo.structured_output.request_grammar import RequestGrammar, request_reasoning
from tests.structured_output.reference import fresh_mask

REGEX = r'\{"n": "[a-z]{1,6}", "k": [0-9]{1,3}\}'


@pytest.fixture(scope="module")
def compiled(tokenizer):
    pool = GrammarCompilerPool(lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
    try:
        params = StructuredOutputsParams(regex=REGEX)
        future = pool.submit(params)
        future.result()
        yield params, future
    finally:
        pool.shutdown()


def test_rows_follow_the_drafts_and_the_state_is_restored(tokenizer, compiled):
    params, future = compiled
    num_words = -(-len(tokenizer) // 32)
    grammar = RequestGrammar(future, params, request_reasoning(params, [1, 2]))
    assert grammar.resolve() and grammar.ready
    text = tokenizer.encode('{"n": "abc", "k": 42}', add_special_tokens=False)
    assert grammar.accept(text[:2])  # tokens the request has already
    drafts = text[2:6]
    rows = np.zeros((len(drafts) + 1, num_words), dtype=np.int32)
    before = fresh_mask(future.result(), text[:2], num_words)
    assert grammar.fill_rows(rows, drafts)
    for j in range(len(drafts) + 1):
        np.testing.assert_array_equal(rows[j], fresh_mask(future.result(), text[:2 + j], num_words))
    # the state is back: the next row is still the one after the two accepted tokens
    assert grammar.num_accepted == 2
    again = np.zeros((1, num_words), dtype=np.int32)
    grammar.matcher.fill_next_token_bitmask(again, 0)
    np.testing.assert_array_equal(again[0], before)

    # a draft the grammar refuses (a letter where the digits go): its row refuses it, the
    # rows after it allow everything
    letter = tokenizer.encode("x", add_special_tokens=False)[0]
    refused = text[2:10] + [letter, text[10]]  # text[:10] is '{"n": "abc", "k": '
    rows = np.zeros((len(refused) + 1, num_words), dtype=np.int32)
    assert grammar.fill_rows(rows, refused)
    np.testing.assert_array_equal(rows[8], fresh_mask(future.result(), text[:10], num_words))
    assert not rows.view(np.uint32)[8, letter // 32] >> (letter % 32) & 1
    assert (rows[9:] == -1).all()
    assert grammar.num_accepted == 2


def test_a_reasoning_prefix_is_unconstrained_until_its_closing_tag(tokenizer, compiled):
    """Drafts that close the reasoning: rows up to the closing tag allow everything, the row
    after it is the grammar's first; the gate is open again afterwards."""
    params, future = compiled
    num_words = -(-len(tokenizer) // 32)
    start, end = 10, 11  # stand-in tag ids
    reasoning = StructuredOutputsParams(regex=REGEX, reasoning_token_ids=[start, end])
    # the prompt opened it
    grammar = RequestGrammar(future, reasoning, request_reasoning(reasoning, [1, start]))
    assert grammar.resolve() and grammar.reasoning
    rows = np.zeros((4, num_words), dtype=np.int32)
    assert grammar.fill_rows(rows, [5, end, tokenizer.encode("{", add_special_tokens=False)[0]])
    assert (rows[:2] == -1).all()
    np.testing.assert_array_equal(rows[2], fresh_mask(future.result(), [], num_words))
    assert grammar.reasoning and grammar.num_accepted == 0
    rows = np.zeros((2, num_words), dtype=np.int32)
    assert not grammar.fill_rows(rows, [5])  # still thinking: no row constrains
