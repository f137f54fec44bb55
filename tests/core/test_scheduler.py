"""Scheduler unit tests, in the style of vLLM's tests/v1/core: every step's token counts are
computed by hand in the comments. Helpers here are shared with test_scheduler_properties.py."""

import zlib
from collections import deque

import pytest

from echo.config import CacheConfig, SchedulerConfig
from echo.core.fake_runner import FakeModelRunner
from echo.core.request import Request, RequestStatus
from echo.core.scheduler import Scheduler
from echo.engine.messages import EngineCoreOutput, ModelRunnerOutput
from echo.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 16, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 64, max_model_len: int = 512,
                   prefix_caching: bool = True, **kwargs) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks, **kwargs)


def make_request(rid: str, prompt: int | list[int], max_tokens: int | None = 16,
                 **params) -> Request:
    if isinstance(prompt, int):  # tokens of this request's own (no shared prefix by chance)
        base = 1000 * (zlib.crc32(rid.encode()) % 1_000_000 + 1)
        prompt = [base + i for i in range(prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(EOS,))


def make_runner(sched: Scheduler, **kwargs) -> FakeModelRunner:
    return FakeModelRunner(sched.block_size, sched.kv.num_blocks, **kwargs)


def scripted(scripts: dict[str, list[int]], prompt_lens: dict[str, int]):
    """A next_token function that emits each request's script, then token 7 forever."""
    def next_token(rid: str, token_ids: list[int]) -> int:
        script = scripts.get(rid, [])
        n = len(token_ids) - prompt_lens[rid]
        return script[n] if n < len(script) else 7
    return next_token


def run(sched: Scheduler, runner: FakeModelRunner, in_flight: int = 1,
        max_steps: int = 10_000) -> dict[str, EngineCoreOutput]:
    """Drive the scheduler like the engine does, with `in_flight` steps outstanding: step N+1 is
    scheduled (and launched) before step N's output is processed. Returns each request's
    outputs merged into one EngineCoreOutput."""
    merged: dict[str, EngineCoreOutput] = {}
    pending: deque = deque()
    for _ in range(max_steps):
        if sched.has_unfinished_requests():
            so = sched.schedule()
            pending.append((so, runner.execute(so)))
        if not pending:
            return merged
        if len(pending) >= in_flight or not sched.has_unfinished_requests():
            for out in sched.update_from_output(*pending.popleft()):
                merge(merged, out)
    raise AssertionError(f"not done after {max_steps} steps")


def merge(merged: dict[str, EngineCoreOutput], out: EngineCoreOutput) -> None:
    prev = merged.get(out.request_id)
    if prev is None:
        merged[out.request_id] = EngineCoreOutput(out.request_id, list(out.new_token_ids),
                                                  list(out.new_logprobs), out.finish_reason,
                                                  out.stop_reason, out.num_cached_tokens)
    else:
        assert prev.finish_reason is None, f"{out.request_id}: output after finishing"
        prev.new_token_ids.extend(out.new_token_ids)
        prev.new_logprobs.extend(out.new_logprobs)
        prev.finish_reason, prev.stop_reason = out.finish_reason, out.stop_reason


def step(sched: Scheduler, runner: FakeModelRunner):
    so = sched.schedule()
    return so, sched.update_from_output(so, runner.execute(so))


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
