"""Scheduler unit tests, in the style of vLLM's tests/v1/core: budget, prefix caching,
admission checks, finishing, stats. Token counts per step are computed by hand in comments."""


import pytest

from echo.core.request import RequestStatus
from echo.core.step_results import ModelRunnerOutput
from tests.core.scheduler_helpers import (
    EOS,
    make_request,
    make_runner,
    make_scheduler,
    run,
    scripted,
    step,
)

# ---- the token budget -------------------------------------------------------------------


def test_first_step_fills_the_budget_exactly():
    sched = make_scheduler(max_num_batched_tokens=64)  # long-prefill threshold 32
    runner = make_runner(sched)
    for rid, n in (("a", 20), ("b", 30), ("c", 25)):
        sched.add_request(make_request(rid, n))
    so, outs = step(sched, runner)
    # a: 20 (others wait behind it), b: 30, c: what is left, 64 - 50 = 14
    assert so.num_scheduled_tokens == {"a": 20, "b": 30, "c": 14}
    assert so.total_num_scheduled_tokens == 64
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a", "b", "c"]
    assert [r.num_computed_tokens for r in so.scheduled_new_reqs] == [0, 0, 0]
    assert [len(r.block_ids) for r in so.scheduled_new_reqs] == [2, 2, 1]
    # a and b finished their prompts and sampled; c is mid-prefill
    assert [(o.request_id, len(o.new_token_ids)) for o in outs] == [("a", 1), ("b", 1)]

    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 11}
    assert so.scheduled_new_reqs == []
    assert so.scheduled_cached_reqs.req_ids == ["a", "b", "c"]
    assert so.scheduled_cached_reqs.num_computed_tokens == [20, 30, 14]
    assert so.scheduled_cached_reqs.new_block_ids == [[], [], [5]]


def test_long_prompt_alone_is_cut_into_budget_sized_chunks():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = make_runner(sched)
    sched.add_request(make_request("long", 150))
    chunks = [step(sched, runner)[0].num_scheduled_tokens["long"] for _ in range(4)]
    assert chunks == [64, 64, 22, 1]


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(max_num_seqs=2)
    runner = make_runner(sched)
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=2))
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    so, outs = step(sched, runner)  # a and b reach max_tokens=2 and finish
    assert {o.request_id: o.finish_reason for o in outs} == {"a": "length", "b": "length"}
    so, _ = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["c"]
    assert so.finished_req_ids == ["a", "b"]


def test_decodes_are_never_starved_by_a_long_prefill_admitted_before_them():
    sched = make_scheduler(max_num_batched_tokens=64)  # threshold 32
    runner = make_runner(sched)
    sched.add_request(make_request("long", 200))
    sched.add_request(make_request("d1", 5))
    sched.add_request(make_request("d2", 5))
    so, _ = step(sched, runner)
    # long is held to 32 for the requests behind it (5 + 5), then topped up with the 22 left
    assert so.num_scheduled_tokens == {"long": 54, "d1": 5, "d2": 5}
    for _ in range(2):
        so, _ = step(sched, runner)
        # long comes first in admission order, yet leaves one token for each decode
        assert so.num_scheduled_tokens == {"long": 62, "d1": 1, "d2": 1}
    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"long": 200 - 54 - 62 - 62, "d1": 1, "d2": 1}


def test_short_prompt_behind_a_long_one_gets_its_first_token_during_the_long_prefill():
    sched = make_scheduler(max_num_batched_tokens=64)  # threshold 32
    runner = make_runner(sched)
    sched.add_request(make_request("long", 300))
    assert step(sched, runner)[0].num_scheduled_tokens == {"long": 64}
    sched.add_request(make_request("short", 10))
    so, outs = step(sched, runner)
    # long is held to 32 while short waits; short takes 10; long gets the 22 left back
    assert so.num_scheduled_tokens == {"long": 54, "short": 10}
    assert [o.request_id for o in outs] == ["short"]
    assert len(outs[0].new_token_ids) == 1
    assert sched.requests["long"].num_computed_tokens == 118 < 300


def test_short_prompt_is_not_stuck_behind_two_running_long_prefills():
    sched = make_scheduler(max_num_batched_tokens=64)  # threshold 32
    runner = make_runner(sched)
    sched.add_request(make_request("l1", 300))
    sched.add_request(make_request("l2", 300))
    assert step(sched, runner)[0].num_scheduled_tokens == {"l1": 32, "l2": 32}
    sched.add_request(make_request("short", 20))
    so, outs = step(sched, runner)
    # running prefills share 32 while someone waits: l1 takes it all, l2 is held back;
    # short gets 20 and its first token; l1 gets the 12 left back
    assert so.num_scheduled_tokens == {"l1": 44, "short": 20}
    assert [o.request_id for o in outs] == ["short"]


def test_empty_schedule_still_counts_steps():
    sched = make_scheduler()
    first, second = sched.schedule(), sched.schedule()
    assert first.is_empty and second.is_empty
    assert (first.step_id, second.step_id) == (0, 1)


# ---- prefix caching ---------------------------------------------------------------------


def test_shared_system_prompt_is_computed_once():
    sched = make_scheduler(block_size=16, max_num_batched_tokens=128)
    runner = make_runner(sched)
    system = list(range(100, 140))  # 40 tokens: two full blocks + 8
    sched.add_request(make_request("a", system + [1, 2, 3]))
    so_a, _ = step(sched, runner)
    sched.add_request(make_request("b", system + [4, 5]))
    so_b, outs = step(sched, runner)
    [new_b] = so_b.scheduled_new_reqs
    assert new_b.num_computed_tokens == 32
    assert so_b.num_scheduled_tokens["b"] == 42 - 32
    a_blocks = so_a.scheduled_new_reqs[0].block_ids
    assert new_b.block_ids[:2] == a_blocks[:2]
    assert new_b.block_ids[2] not in a_blocks
    refs = sched.kv.pool.ref_counts
    assert [refs[b] for b in new_b.block_ids] == [2, 2, 1]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (43 + 42, 32)
    assert {o.request_id: o.num_cached_tokens for o in outs} == {"a": 0, "b": 32}


def test_eviction_drops_the_least_recently_freed_prefix_first():
    sched = make_scheduler(num_blocks=6, block_size=8, max_num_batched_tokens=64)
    runner = make_runner(sched)
    old, new = list(range(10, 26)), list(range(30, 46))
    for rid, prompt in (("old", old), ("new", new)):
        sched.add_request(make_request(rid, prompt + [1], max_tokens=1))
        run(sched, runner)  # each leaves two cached blocks behind
    assert sched.kv.pool.num_cached_blocks() == 4
    # 32 tokens need 4 blocks: the 2 plain free ones, then evict old's 2, freed first
    sched.add_request(make_request("other", list(range(50, 82)), max_tokens=1))
    run(sched, runner)
    assert sched.kv.get_computed_blocks(make_request("p1", new + [2])).num_tokens == 16
    assert sched.kv.get_computed_blocks(make_request("p2", old + [2])).num_tokens == 0


def test_reset_prefix_cache():
    sched = make_scheduler()
    runner = make_runner(sched)
    prompt = list(range(40))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    step(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=4))
    step(sched, runner)
    assert sched.reset_prefix_cache() is False  # b still holds blocks
    run(sched, runner)
    assert sched.reset_prefix_cache() is True
    assert sched.kv.get_computed_blocks(make_request("c", prompt)).num_tokens == 0


# ---- add_request checks -----------------------------------------------------------------


def test_request_that_can_never_fit_is_rejected_before_queuing():
    sched = make_scheduler(num_blocks=4, block_size=16)  # 64 tokens of KV
    with pytest.raises(ValueError) as info:
        sched.add_request(make_request("big", 40, max_tokens=30))
    msg = str(info.value)
    for part in ("prompt length 40", "max_tokens 30", "5 blocks", "4 blocks"):
        assert part in msg
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("fits", 40, max_tokens=24))  # exactly 64 tokens
    assert sched.get_num_unfinished_requests() == 1


def test_max_model_len_bounds_the_kv_a_request_needs():
    sched = make_scheduler(num_blocks=4, block_size=16, max_model_len=64)
    sched.add_request(make_request("capped", 40, max_tokens=None))  # up to 64 tokens
    with pytest.raises(ValueError, match="exceeds max_model_len 64"):
        sched.add_request(make_request("too-long", 65))


def test_duplicate_and_empty_requests_are_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", []))


# ---- finishing --------------------------------------------------------------------------


def finish_of(scripts: dict, **params) -> tuple[list[int], str, int | None]:
    sched = make_scheduler(max_model_len=params.pop("max_model_len", 512))
    prompt_len = params.pop("prompt_len", 3)
    runner = make_runner(sched, next_token=scripted(scripts, {"r": prompt_len}))
    sched.add_request(make_request("r", prompt_len, **params))
    out = run(sched, runner)["r"]
    return out.new_token_ids, out.finish_reason, out.stop_reason


def test_finish_on_eos():
    assert finish_of({"r": [5, 6, EOS, 8]}) == ([5, 6, EOS], "stop", None)


def test_ignore_eos_runs_to_max_tokens():
    assert finish_of({"r": [5, EOS, 6]}, max_tokens=4, ignore_eos=True) == (
        [5, EOS, 6, 7], "length", None)


def test_stop_token_id_sets_stop_reason():
    assert finish_of({"r": [5, 9, 6]}, stop_token_ids=[9]) == ([5, 9], "stop", 9)


def test_min_tokens_suppresses_eos_and_stop_ids():
    assert finish_of({"r": [EOS, 9, EOS, 4]}, min_tokens=3, stop_token_ids=[9]) == (
        [EOS, 9, EOS], "stop", None)


def test_max_tokens_and_max_model_len_finish_with_length():
    assert finish_of({}, max_tokens=3) == ([7, 7, 7], "length", None)
    # 10-token prompt, max_model_len 12: two tokens make 12 tokens
    assert finish_of({}, max_tokens=50, max_model_len=12, prompt_len=10) == (
        [7, 7], "length", None)
    # a prompt of max_model_len tokens still gets one token
    assert finish_of({}, max_tokens=50, max_model_len=12, prompt_len=12) == (
        [7], "length", None)


def test_stop_token_on_the_last_allowed_token_counts_as_stop():
    assert finish_of({"r": [5, 9]}, max_tokens=2, stop_token_ids=[9]) == ([5, 9], "stop", 9)


def test_finished_request_frees_its_blocks_and_is_forgotten_by_workers():
    sched = make_scheduler()
    runner = make_runner(sched)
    sched.add_request(make_request("r", 20, max_tokens=2))
    step(sched, runner)
    _, outs = step(sched, runner)
    assert outs[0].finish_reason == "length"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.running == [] and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["r"]


def test_logprobs_are_passed_through():
    sched = make_scheduler()
    runner = make_runner(sched)
    sched.add_request(make_request("r", 4, max_tokens=2, logprobs=1))
    out = run(sched, runner)["r"]
    assert [e.logprob for e in out.new_logprobs] == [-float(t % 7) for t in out.new_token_ids]
    assert len(out.new_logprobs) == 2


# ---- stats ------------------------------------------------------------------------------


def test_stats_count_running_waiting_usage():
    sched = make_scheduler(num_blocks=10, block_size=16, max_num_seqs=2)
    runner = make_runner(sched)
    for rid in "abc":
        sched.add_request(make_request(rid, 20))
    step(sched, runner)
    stats = sched.make_stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 10)
    assert stats.num_total_blocks == 10
    assert stats.num_preemptions == 0


def test_runner_output_for_unknown_requests_is_ignored():
    sched = make_scheduler()
    so = sched.schedule()
    assert sched.update_from_output(so, ModelRunnerOutput(so.step_id, ["ghost"], [[3]])) == []


def test_request_state_after_first_step():
    sched = make_scheduler()
    runner = make_runner(sched)
    request = make_request("r", 10)
    sched.add_request(request)
    assert request.status == RequestStatus.WAITING
    step(sched, runner)
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 10
    assert request.num_output_tokens == 1
    assert request.num_output_placeholders == 0
    assert request.num_cached_tokens == 0
    assert request.first_scheduled_time is not None
