"""StructuredOutputManager with many requests a step: every matcher ends where a fresh
xgrammar matcher fed the same tokens does (its next mask equal), a refused token is reported
for its own request, and finished requests are forgotten."""

import numpy as np
import pytest

from echo import SamplingParams, StructuredOutputsParams
from echo.core.request import Request
from echo.core.step_results import EngineCoreOutput
from echo.structured_output.manager import StructuredOutputManager
from tests.structured_output.reference import fresh_mask

REGEX = r"[a-z]{1,40}"
NUM_REQUESTS = 32


def make_manager(tokenizer, num_processes=0, rows_per_seq=1):
    return StructuredOutputManager(lambda: tokenizer, len(tokenizer), (tokenizer.eos_token_id,),
                                   max_num_seqs=NUM_REQUESTS, rows_per_seq=rows_per_seq,
                                   num_processes=num_processes)


@pytest.fixture(params=[0, 2], ids=["busy-loop", "2-processes"])
def manager(tokenizer, request):
    """A manager with NUM_REQUESTS requests r0, r1, ... under REGEX, compiled; its matchers in
    the busy loop or in two grammar processes."""
    manager = make_manager(tokenizer, request.param)
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
    # the host time the engine's stats report: accepts so far, fills once a mask is made
    assert manager.accept_seconds > 0
    assert (manager.fill_seconds, manager.bitmask_steps) == (0.0, 0)
    live = [rid for i, rid in enumerate(ids) if i not in (0, refused_at)]
    mask = manager.bitmask(7, live)
    assert mask.req_ids == live and manager.bitmask_steps == 1
    assert manager.fill_seconds > 0
    rows = np.frombuffer(mask.rows, dtype=np.int32).reshape(len(live), -1)
    for rid, row in zip(live, rows):
        np.testing.assert_array_equal(
            row, fresh_mask(compiled, texts[ids.index(rid)][:steps], mask.num_words),
            err_msg=rid)


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
        np.testing.assert_array_equal(row, fresh_mask(compiled, sampled.get(rid, []),
                                                      mask.num_words), err_msg=rid)
    assert finished not in manager.grammars
    assert manager.bitmask_steps == 1 and manager.fill_seconds > 0
    # the request that was only advanced: its next row follows its tokens too
    mask = manager.bitmask(10, [leaving])
    np.testing.assert_array_equal(np.frombuffer(mask.rows, dtype=np.int32),
                                  fresh_mask(compiled, sampled[leaving], mask.num_words))


@pytest.mark.parametrize("num_processes", [0, 2])
def test_draft_rows_follow_each_draft_in_the_busy_loop_and_in_processes(tokenizer,
                                                                         num_processes):
    """With drafts (speculative decoding) a request gets a row per draft and one after, each
    the mask of a fresh matcher fed the drafts before it; a request without drafts gets one."""
    manager = make_manager(tokenizer, num_processes, rows_per_seq=4)
    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX))
        for rid in ("a", "b", "c"):
            manager.add(Request(rid, [1, 2, 3], params))
        manager.wait_for_compiles(30)
        assert manager.poll() == []
        compiled = manager.grammars["a"].future.result()
        word = tokenizer.encode("zebrariverstonequiet", add_special_tokens=False)
        drafts = {"a": word[1:4], "c": word[1:2]}
        refused, mask = manager.accept_and_fill([EngineCoreOutput("a", word[:1])], 3,
                                                ["a", "b", "c"], drafts)
        assert refused == [] and mask.req_ids == ["a", "b", "c"]
        assert mask.row_counts == [4, 1, 2]
        rows = np.frombuffer(mask.rows, dtype=np.int32).reshape(7, -1)
        expected = [word[:1 + j] for j in range(4)] + [[]] + [[], word[1:2]]
        for row, tokens in zip(rows, expected):
            np.testing.assert_array_equal(row, fresh_mask(compiled, tokens, mask.num_words))
        # the drafts were not accepted: the next mask follows the sampled token only
        mask = manager.bitmask(4, ["a"])
        np.testing.assert_array_equal(np.frombuffer(mask.rows, dtype=np.int32),
                                      fresh_mask(compiled, word[:1], mask.num_words))
    finally:
        manager.shutdown()


def test_a_shut_down_manager_starts_no_processes(tokenizer):
    manager = make_manager(tokenizer, num_processes=2)
    manager.shutdown()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX))
    with pytest.raises(ValueError, match="shut down"):
        manager.add(Request("late", [1, 2, 3], params))
    assert manager.grammar_process_pids() == []
