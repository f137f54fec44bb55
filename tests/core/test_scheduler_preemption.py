"""Scheduler unit tests: preemption, aborts in every state, and two steps in flight."""


import pytest

from echo.core.request import RequestStatus
from tests.core.scheduler_helpers import (
    EOS,
    make_request,
    make_runner,
    make_scheduler,
    run,
    scripted,
    step,
)

# ---- preemption -------------------------------------------------------------------------


def test_preemption_requeues_the_newest_request_and_reuses_its_cached_prefix():
    # 4 blocks of 8: a and b take two each; a's 17th token then needs a block
    sched = make_scheduler(num_blocks=4, block_size=8)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 16, max_tokens=4))
    sched.add_request(make_request("b", 16, max_tokens=4))
    so, outs = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 16, "b": 16}
    b = sched.requests["b"]
    b_first = outs[1].new_token_ids

    so, _ = step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == ["b"]  # the workers drop b before this step
    assert b.status == RequestStatus.PREEMPTED
    assert list(sched.waiting) == [b] and sched.running == [sched.requests["a"]]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.make_stats().num_preemptions == 1
    # a took b's tail block (evicted first); b's first block stays cached
    assert sched.kv.get_block_ids(sched.requests["a"]) == [0, 1, 3]

    so, _ = step(sched, runner)  # b waits: its cached block and one more would be all 4
    assert list(so.num_scheduled_tokens) == ["a"]
    so, outs = step(sched, runner)
    assert list(so.num_scheduled_tokens) == ["a"]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "length")]
    # b comes back as a new request: its output so far, its cached first block reused
    so, _ = step(sched, runner)
    [new_b] = so.scheduled_new_reqs
    assert new_b.req_id == "b"
    assert new_b.output_token_ids == b_first
    assert new_b.num_computed_tokens == 8
    assert new_b.block_ids[0] == 2
    assert so.num_scheduled_tokens == {"b": 17 - 8}


def test_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=5, block_size=8)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 16, max_tokens=12))
    sched.add_request(make_request("b", 16, max_tokens=12))
    step(sched, runner)
    so, _ = step(sched, runner)  # a takes the last free block; b finds none
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.finished_req_ids == ["b"]
    assert sched.requests["b"].status == RequestStatus.PREEMPTED


def test_outputs_are_identical_with_and_without_preemption():
    def outputs(num_blocks: int) -> tuple[dict, int]:
        sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_batched_tokens=48)
        runner = make_runner(sched, vocab_size=40)
        for i in range(12):
            sched.add_request(make_request(f"r{i}", 5 + 7 * i % 30, max_tokens=10 + 3 * i % 25))
        merged = run(sched, runner)
        return ({rid: (o.new_token_ids, o.finish_reason) for rid, o in merged.items()},
                sched.num_preemptions)

    roomy, roomy_preemptions = outputs(num_blocks=200)
    tight, tight_preemptions = outputs(num_blocks=9)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy


# ---- aborts -----------------------------------------------------------------------------


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    step(sched, runner)
    [out] = sched.abort_requests(["b"])
    assert (out.request_id, out.new_token_ids, out.finish_reason) == ("b", [], "abort")
    assert list(sched.waiting) == []
    assert sched.get_num_unfinished_requests() == 1
    assert sched.schedule().finished_req_ids == []  # the workers never saw b


def test_abort_waiting_request_blocked_on_memory_forgets_its_lookups():
    sched = make_scheduler(num_blocks=4, block_size=8)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 24, max_tokens=8))
    sched.add_request(make_request("b", 24, max_tokens=8))
    step(sched, runner)
    assert [r.request_id for r in sched.waiting] == ["b"]
    sched.abort_requests(["b"])
    assert sched.kv.tracked_block_tables().keys() == {"a"}


@pytest.mark.parametrize("steps", [1, 3], ids=["mid-prefill", "decoding"])
def test_abort_running_request_frees_every_block_at_once(steps):
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = make_runner(sched)
    sched.add_request(make_request("r", 100))  # prefill takes two steps
    for _ in range(steps):
        step(sched, runner)
    assert sched.kv.num_free_blocks < sched.kv.num_blocks
    [out] = sched.abort_requests(["r"])
    assert out.finish_reason == "abort"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
    assert sched.running == [] and not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == ["r"]


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=4, block_size=8)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 16, max_tokens=4))
    sched.add_request(make_request("b", 16, max_tokens=4))
    step(sched, runner)
    so, _ = step(sched, runner)
    assert so.finished_req_ids == ["b"]  # preempted
    [out] = sched.abort_requests(["b"])
    assert out.finish_reason == "abort"
    assert list(sched.waiting) == []
    assert sched.schedule().finished_req_ids == []  # already dropped by the workers


def test_abort_ignores_unknown_and_finished_ids():
    sched = make_scheduler()
    runner = make_runner(sched)
    sched.add_request(make_request("done", 4, max_tokens=1))
    run(sched, runner)
    assert sched.abort_requests(["done", "never-seen"]) == []


def test_abort_while_its_step_is_in_flight_discards_the_result():
    sched = make_scheduler()
    runner = make_runner(sched)
    sched.add_request(make_request("r", 8))
    sched.add_request(make_request("s", 8))
    so = sched.schedule()
    runner_out = runner.execute(so)
    sched.abort_requests(["r"])
    assert sched.kv.get_block_ids(sched.requests["s"]) == [1]
    assert [o.request_id for o in sched.update_from_output(so, runner_out)] == ["s"]


# ---- two steps in flight ----------------------------------------------------------------


def test_decode_is_scheduled_on_a_placeholder_before_the_token_is_back():
    sched = make_scheduler()
    runner = make_runner(sched)
    request = make_request("r", 10)
    sched.add_request(request)
    so0 = sched.schedule()
    out0 = runner.execute(so0)
    assert (request.num_computed_tokens, request.num_output_placeholders) == (10, 1)
    so1 = sched.schedule()  # before step 0's output
    assert so1.num_scheduled_tokens == {"r": 1}
    assert so1.scheduled_cached_reqs.num_computed_tokens == [10]
    assert (request.num_computed_tokens, request.num_output_placeholders) == (11, 2)
    out1 = runner.execute(so1)
    [o] = sched.update_from_output(so0, out0)
    assert request.output_token_ids == o.new_token_ids == out0.sampled_token_ids[0]
    assert request.num_output_placeholders == 1
    sched.update_from_output(so1, out1)
    assert request.output_token_ids == out0.sampled_token_ids[0] + out1.sampled_token_ids[0]
    assert request.num_output_placeholders == 0


def test_no_step_is_scheduled_past_max_tokens():
    sched = make_scheduler()
    runner = make_runner(sched)
    sched.add_request(make_request("r", 10, max_tokens=2))
    so0 = sched.schedule()
    out0 = runner.execute(so0)
    so1 = sched.schedule()
    assert so1.num_scheduled_tokens == {"r": 1}  # the second and last token
    sched.update_from_output(so0, out0)
    assert sched.schedule().num_scheduled_tokens == {}  # its last token is in flight


def test_token_after_a_stop_in_flight_is_discarded():
    sched = make_scheduler()
    runner = make_runner(sched, next_token=scripted({"r": [5, EOS, 6, 6]}, {"r": 4}))
    sched.add_request(make_request("r", 4))
    merged = run(sched, runner, in_flight=2)
    assert merged["r"].new_token_ids == [5, EOS]
    assert merged["r"].finish_reason == "stop"
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


@pytest.mark.parametrize("num_blocks", [200, 10], ids=["roomy", "preempting"])
def test_two_steps_in_flight_give_the_synchronous_outputs(num_blocks):
    def outputs(in_flight: int) -> dict:
        sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_batched_tokens=48)
        runner = make_runner(sched, vocab_size=30)  # small vocab: EOS (0) now and then
        system = list(range(300, 320))
        for i in range(10):
            prompt = system + [i] * (3 + 5 * i % 17) if i % 2 else 4 + 9 * i % 40
            sched.add_request(make_request(f"r{i}", prompt, max_tokens=6 + 5 * i % 20,
                                           stop_token_ids=[29]))
        merged = run(sched, runner, in_flight=in_flight)
        assert sched.kv.num_free_blocks == sched.kv.num_blocks
        return {rid: (o.new_token_ids, o.finish_reason, o.stop_reason)
                for rid, o in merged.items()}

    sync = outputs(in_flight=1)
    assert {reason for _, reason, _ in sync.values()} >= {"stop", "length"}
    assert outputs(in_flight=2) == sync


def test_long_prefill_threshold_defaults_to_half_the_budget_and_is_validated():
    assert make_scheduler(max_num_batched_tokens=64).long_prefill_token_threshold == 32
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=65)
