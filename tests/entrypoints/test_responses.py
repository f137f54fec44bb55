"""Response bodies from hand-built outputs: the logprobs of the sampled token; n > 1 finishes."""

import pytest

from echo.entrypoints.responses import ChoiceState
from echo.outputs import CompletionOutput, Logprob

# token id -> text; logprobs of a made-up step: top-3 are 10 ("a"), 11 ("b"), 12 ("c")
TEXT = {10: "a", 11: "b", 12: "c", 13: "d"}


def entry(sampled: int) -> dict[int, Logprob]:
    """A logprobs dict as the output processor builds it: top-3 ranked, plus the sampled token
    unranked with its own logprob when it is outside the top-3."""
    top = {10: Logprob(-0.5, 1, "a"), 11: Logprob(-1.25, 2, "b"), 12: Logprob(-2.0, 3, "c")}
    if sampled not in top:
        top[sampled] = Logprob(-7.5, None, TEXT[sampled])
    return top


# sampled tokens: rank 2, outside the top-3, rank 1
SAMPLED = [11, 13, 10]
EXPECTED_TOKENS = ["b", "d", "a"]
EXPECTED_LOGPROBS = [-1.25, -7.5, -0.5]
TOP = [{"a": -0.5, "b": -1.25, "c": -2.0}] * 3


def whole() -> CompletionOutput:
    return CompletionOutput(index=0, text="bda", token_ids=list(SAMPLED),
                            logprobs=[entry(t) for t in SAMPLED], finish_reason="length")


def streamed() -> list[CompletionOutput]:
    """Cumulative outputs, one token per step, as the output processor snapshots them."""
    outs = []
    for i in range(1, len(SAMPLED) + 1):
        outs.append(CompletionOutput(
            index=0, text="bda"[:i], token_ids=SAMPLED[:i],
            logprobs=[entry(t) for t in SAMPLED[:i]], delta_text="bda"[i - 1],
            delta_token_ids=SAMPLED[i - 1:i],
            finish_reason="length" if i == len(SAMPLED) else None))
    return outs


def check_chat(content: list[dict]) -> None:
    assert [c["token"] for c in content] == EXPECTED_TOKENS
    assert [c["logprob"] for c in content] == EXPECTED_LOGPROBS
    assert [c["bytes"] for c in content] == [list(t.encode()) for t in EXPECTED_TOKENS]
    for c in content:  # top_logprobs stay the top-3, the unranked sampled token not among them
        assert [(t["token"], t["logprob"]) for t in c["top_logprobs"]] == [
            ("a", -0.5), ("b", -1.25), ("c", -2.0)]


def check_completion(logprobs: dict) -> None:
    assert logprobs["tokens"] == EXPECTED_TOKENS
    assert logprobs["token_logprobs"] == EXPECTED_LOGPROBS
    assert logprobs["top_logprobs"] == TOP


def test_whole_choice_reports_the_sampled_token_not_the_argmax():
    chat = ChoiceState(0, None, chat=True)
    chat.absorb(whole())
    check_chat(chat.final_choice()["logprobs"]["content"])
    completion = ChoiceState(0, None, chat=False)
    completion.absorb(whole())
    check_completion(completion.final_choice()["logprobs"])


@pytest.mark.parametrize("chat", [True, False])
def test_streamed_choice_reports_the_sampled_token_not_the_argmax(chat):
    state = ChoiceState(0, None, chat=chat)
    chunks = [state.delta(out) for out in streamed()]
    assert all(c is not None for c in chunks)
    if chat:
        check_chat(sum((c["logprobs"]["content"] for c in chunks), []))
    else:
        merged = {k: sum((c["logprobs"][k] for c in chunks), [])
                  for k in ("tokens", "token_logprobs", "top_logprobs")}
        check_completion(merged)


def test_sampled_token_without_a_decoded_text_is_decoded_by_its_own_id():
    class Tokenizer:
        def decode(self, ids):
            return f"<{ids[0]}>"

    lp = {10: Logprob(-0.5, 1), 11: Logprob(-1.25, 2)}
    state = ChoiceState(0, Tokenizer(), chat=False)
    state.absorb(CompletionOutput(index=0, token_ids=[11], logprobs=[lp],
                                  finish_reason="length"))
    logprobs = state.final_choice()["logprobs"]
    assert logprobs["tokens"] == ["<11>"] and logprobs["token_logprobs"] == [-1.25]


@pytest.mark.parametrize("chat", [True, False])
def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(chat):
    """vLLM's return_tokens_as_token_ids: "token_id:ID" in place of the decoded text, for the
    sampled token and the top ones, whatever the detokenizer made of them."""
    lp = {10: Logprob(-0.5, 1, decoded_token="a"), 11: Logprob(-1.25, 2, decoded_token="\ufffd")}
    state = ChoiceState(0, None, chat=chat, tokens_as_ids=True)
    state.absorb(CompletionOutput(index=0, text="\ufffd", token_ids=[11], logprobs=[lp],
                                  finish_reason="length"))
    logprobs = state.final_choice()["logprobs"]
    if chat:
        (entry,) = logprobs["content"]
        assert entry["token"] == "token_id:11" and entry["bytes"] == list(b"token_id:11")
        assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:10", "token_id:11"]
    else:
        assert logprobs["tokens"] == ["token_id:11"]
        assert logprobs["top_logprobs"] == [{"token_id:10": -0.5, "token_id:11": -1.25}]


@pytest.mark.parametrize("chat", [True, False])
def test_n_gt_1_stream_sends_each_finish_chunk_once(chat):
    # choice 0 finishes at step 1 (stop token), choice 1 at step 3; the request's outputs keep
    # carrying choice 0, finished, until then
    steps = [
        [CompletionOutput(0, "x", [5], delta_text="x", delta_token_ids=[5]),
         CompletionOutput(1, "p", [7], delta_text="p", delta_token_ids=[7])],
        [CompletionOutput(0, "x", [5, 2], delta_text="", delta_token_ids=[2],
                          finish_reason="stop", stop_reason=2),
         CompletionOutput(1, "pq", [7, 8], delta_text="q", delta_token_ids=[8])],
        [CompletionOutput(0, "x", [5, 2], finish_reason="stop", stop_reason=2),
         CompletionOutput(1, "pqr", [7, 8, 9], delta_text="r", delta_token_ids=[9])],
        [CompletionOutput(0, "x", [5, 2], finish_reason="stop", stop_reason=2),
         CompletionOutput(1, "pqrs", [7, 8, 9, 3], delta_text="s", delta_token_ids=[3],
                          finish_reason="length")],
    ]
    states = [ChoiceState(i, None, chat=chat, return_token_ids=True) for i in range(2)]
    chunks = [[], []]
    for outputs in steps:
        for state, out in zip(states, outputs):
            choice = state.delta(out)
            if choice is not None:
                chunks[out.index].append(choice)
    finishes = [[c["finish_reason"] for c in cs] for cs in chunks]
    assert finishes == [[None, "stop"], [None, None, None, "length"]]
    assert [sum((c["token_ids"] for c in cs), []) for cs in chunks] == [[5, 2], [7, 8, 9, 3]]
    key = "delta" if chat else None
    texts = ["".join(c[key]["content"] if key else c["text"] for c in cs) for cs in chunks]
    assert texts == ["x", "pqrs"]
    assert [s.num_tokens for s in states] == [2, 4]
