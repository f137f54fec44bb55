"""StructuredOutputManager with many requests a step: every matcher ends where a fresh
xgrammar matcher fed the same tokens does (its next mask equal), a refused token is reported
for its own request, and finished requests are forgotten."""

import numpy as np
import pytest
import xgrammar
from transformers import AutoTokenizer

from echo import SamplingParams, StructuredOutputsParams
from echo.core.request import Request
from echo.core.step_results import EngineCoreOutput
from echo.structured_output.manager import StructuredOutputManager

REGEX = r"[a-z]{1,40}"
NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def tokenizer():
    from echo.models.default_model import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.fixture
def manager(tokenizer):
    """A manager with NUM_REQUESTS requests r0, r1, ... under REGEX, compiled."""
    manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer),
                                      (tokenizer.eos_token_id,), max_num_seqs=NUM_REQUESTS)
    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX))
        for i in range(NUM_REQUESTS):
            manager.add(Request(f"r{i}", [1, 2, 3], params))
        manager.wait_for_compiles(30)
        assert manager.poll() == []
        yield manager
    finally:
        manager.shutdown()


def test_many_requests_advance_as_fresh_matchers_do(tokenizer, manager):
    ids = [f"r{i}" for i in range(NUM_REQUESTS)]
    compiled = manager.grammars[ids[0]].future.result()
    # each request its own lowercase text, one token a step (the regex allows them all)
    words = ["abc", "hello", "zebra", "quiet", "lamp", "river", "stone", "maple"]
    texts = [tokenizer.encode(words[i % len(words)] * (1 + i % 3), add_special_tokens=False)
             for i in range(NUM_REQUESTS)]
    steps = min(len(t) for t in texts)
    refused_at = NUM_REQUESTS // 2
    for step in range(steps):
        outputs = [EngineCoreOutput(rid, [text[step]]) for rid, text in zip(ids, texts)]
        if step == steps - 1:
            outputs[refused_at].new_token_ids = tokenizer.encode(
                " 7", add_special_tokens=False)  # a space and a digit: never allowed
            outputs[0].finish_reason = "length"
        refused = manager.accept(outputs)
    assert [rid for rid, _ in refused] == [ids[refused_at]]
    assert ids[0] not in manager.grammars and len(manager.grammars) == NUM_REQUESTS - 1
    num_words = -(-len(tokenizer) // 32)
    for i, rid in enumerate(ids[1:], start=1):
        if i == refused_at:
            continue
        fresh = xgrammar.GrammarMatcher(compiled)
        for token in texts[i][:steps]:
            assert fresh.accept_token(token)
        expected = np.zeros((1, num_words), dtype=np.int32)
        fresh.fill_next_token_bitmask(expected, 0)
        got = np.zeros((1, num_words), dtype=np.int32)
        manager.grammars[rid].matcher.fill_next_token_bitmask(got, 0)
        np.testing.assert_array_equal(got, expected, err_msg=rid)
        assert manager.grammars[rid].num_accepted == steps
    # the host time the engine's stats report: accepts so far, fills once a mask is made
    assert manager.accept_seconds > 0
    assert (manager.fill_seconds, manager.bitmask_steps) == (0.0, 0)
    mask = manager.bitmask(7, ids[1:3])
    assert mask.req_ids == ids[1:3] and manager.bitmask_steps == 1
    assert manager.fill_seconds > 0


def test_accept_and_fill_masks_the_next_step_as_fresh_matchers_do(tokenizer, manager):
    """One pass advances the landed step's requests and fills the next step's rows: a request
    that finished or whose token was refused gets no row, one that sampled nothing is filled
    as it stands, one not in the next step is only advanced; each row equals the mask of a
    fresh xgrammar matcher fed the same tokens."""
    ids = [f"r{i}" for i in range(NUM_REQUESTS)]
    compiled = manager.grammars[ids[0]].future.result()
    word = tokenizer.encode("maple", add_special_tokens=False)
    finished, refused_id, idle, leaving = ids[0], ids[1], ids[2], ids[3]
    outputs = [EngineCoreOutput(rid, word[:1 + i % len(word)])
               for i, rid in enumerate(ids) if rid != idle]
    outputs[0].finish_reason = "stop"
    outputs[1].new_token_ids = tokenizer.encode(" 7", add_special_tokens=False)
    next_step = [rid for rid in ids if rid != leaving]
    refused, mask = manager.accept_and_fill(outputs, 9, next_step)
    assert [rid for rid, _ in refused] == [refused_id]
    assert mask.step_id == 9
    assert mask.req_ids == [rid for rid in next_step if rid not in (finished, refused_id)]
    got = np.frombuffer(mask.rows, dtype=np.int32).reshape(len(mask.req_ids), -1)
    sampled = {o.request_id: o.new_token_ids for o in outputs}
    for row, rid in zip(got, mask.req_ids):
        fresh = xgrammar.GrammarMatcher(compiled)
        for token in sampled.get(rid, []):
            assert fresh.accept_token(token)
        expected = np.zeros((1, mask.num_words), dtype=np.int32)
        fresh.fill_next_token_bitmask(expected, 0)
        np.testing.assert_array_equal(row, expected[0], err_msg=rid)
    assert manager.grammars[leaving].num_accepted == len(sampled[leaving])
    assert finished not in manager.grammars
    assert manager.bitmask_steps == 1 and manager.fill_seconds > 0
