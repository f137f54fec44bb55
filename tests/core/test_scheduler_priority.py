"""scheduling_policy="priority": admission by (priority, arrival), preemption of the worst
priority, fcfs refusing priorities, and outputs that do not depend on the priorities."""

from collections import deque

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from echo.config import CacheConfig, SchedulerConfig
from echo.core.request import RequestStatus
from echo.core.request_queue import PriorityWaitingQueue, priority_key
from echo.core.scheduler import Scheduler
from tests.core.fake_runner import default_next_token
from tests.core.scheduler_helpers import make_request, make_runner, merge, run, step
from tests.core.test_scheduler_properties import check_invariants


def make_scheduler(policy: str = "priority", num_blocks: int = 64, block_size: int = 16,
                   max_num_seqs: int = 16, max_num_batched_tokens: int = 64,
                   max_model_len: int = 512, **kwargs) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, scheduling_policy=policy),
        CacheConfig(block_size=block_size), num_blocks, **kwargs)


def make(rid: str, prompt, priority: int = 0, arrival: float | None = None, **kwargs):
    request = make_request(rid, prompt, **kwargs)
    request.priority = priority
    if arrival is not None:
        request.arrival_time = arrival
    return request


def greedy(prompt: list[int], max_tokens: int, vocab_size: int = 1000) -> list[int]:
    """The fake runner's tokens with ignore_eos: a function of the sequence only."""
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(default_next_token(prompt + out, vocab_size))
    return out


def admission_order(sched: Scheduler, runner) -> list[str]:
    order = []
    while sched.has_unfinished_requests():
        so, _ = step(sched, runner)
        order += [new.req_id for new in so.scheduled_new_reqs if new.req_id not in order]
    return order


# ---- admission --------------------------------------------------------------------------


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(max_num_seqs=1)
    runner = make_runner(sched)
    # d is queued before c but arrived later: among equal priorities arrival decides
    for rid, priority, arrival in [("a", 3, 1.0), ("b", 0, 2.0), ("d", 1, 4.0), ("c", 1, 3.0),
                                   ("e", -2, 5.0), ("f", 3, 0.5)]:
        sched.add_request(make(rid, 8, priority, arrival, max_tokens=2))
    assert [r.request_id for r in sched.waiting] == ["e", "b", "c", "d", "f", "a"]
    assert admission_order(sched, runner) == ["e", "b", "c", "d", "f", "a"]


def test_a_better_priority_overtakes_requests_queued_before_it_but_never_a_running_one():
    sched = make_scheduler(max_num_seqs=1)
    runner = make_runner(sched)
    sched.add_request(make("first", 8, priority=5, max_tokens=3))
    step(sched, runner)  # first is running
    sched.add_request(make("low", 8, priority=9, max_tokens=3))
    sched.add_request(make("mid", 8, priority=5, max_tokens=3))
    sched.add_request(make("high", 8, priority=1, max_tokens=3))
    assert [r.request_id for r in sched.running] == ["first"]  # no preemption for a seat
    assert admission_order(sched, runner) == ["high", "mid", "low"]


def test_fcfs_admits_in_queue_order_whatever_the_arrival_times():
    sched = make_scheduler("fcfs", max_num_seqs=1)
    runner = make_runner(sched)
    for rid, arrival in [("a", 3.0), ("b", 1.0), ("c", 2.0)]:
        sched.add_request(make(rid, 8, arrival=arrival, max_tokens=2))
    assert admission_order(sched, runner) == ["a", "b", "c"]


@pytest.mark.parametrize("priority", [1, -1])
def test_fcfs_refuses_a_priority_other_than_zero(priority):
    sched = make_scheduler("fcfs")
    with pytest.raises(ValueError, match=r"^priority: .*scheduling_policy='priority'"):
        sched.add_request(make("a", 8, priority=priority))
    assert not sched.has_unfinished_requests()
    sched.add_request(make("b", 8, priority=0))


@pytest.mark.parametrize("priority", [2**63, 1.5, True, "1"])
def test_priority_must_be_a_64_bit_integer(priority):
    sched = make_scheduler()
    with pytest.raises(ValueError, match=r"^priority: must be a 64-bit integer"):
        sched.add_request(make("a", 8, priority=priority))


def test_scheduling_policy_is_checked_and_defaults_to_fcfs():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match=r"^scheduling_policy: 'lifo' is not one of"):
        SchedulerConfig(scheduling_policy="lifo")


# ---- preemption -------------------------------------------------------------------------


def _preemption_case(policy: str):
    # 4 blocks of 16: a (admitted first, worst priority) holds 2 once it decodes, b and c one
    # each; b's and c's first decodes then need a block each, and none is free
    sched = make_scheduler(policy, num_blocks=4)
    runner = make_runner(sched)
    priorities = {"a": 2, "b": 0, "c": 1} if policy == "priority" else dict.fromkeys("abc", 0)
    prompts = {rid: [100 * (i + 1) + j for j in range(16)] for i, rid in enumerate("abc")}
    merged = {}
    sched.add_request(make("a", prompts["a"], priorities["a"], max_tokens=4, ignore_eos=True))
    for out in step(sched, runner)[1]:
        merge(merged, out)
    for rid in "bc":
        sched.add_request(make(rid, prompts[rid], priorities[rid], max_tokens=4,
                               ignore_eos=True))
    for _ in range(2):
        so, outs = step(sched, runner)
        for out in outs:
            merge(merged, out)
    return sched, runner, prompts, merged, so


def test_preemption_takes_the_worst_priority_not_the_newest():
    sched, runner, prompts, merged, so = _preemption_case("priority")
    a, b, c = (sched.requests[rid] for rid in "abc")
    assert a.status == RequestStatus.PREEMPTED and a.num_preemptions == 1
    assert so.finished_req_ids == ["a"] and set(so.num_scheduled_tokens) == {"b", "c"}
    assert sched.running == [b, c]  # kept in priority order
    assert list(sched.waiting) == [a]
    for out in run(sched, runner).values():
        merge(merged, out)
    assert {rid: out.new_token_ids for rid, out in merged.items()} == {
        rid: greedy(prompts[rid], 4) for rid in "abc"}


def test_fcfs_still_preempts_the_most_recently_admitted():
    sched, runner, prompts, merged, so = _preemption_case("fcfs")
    a, b, c = (sched.requests[rid] for rid in "abc")
    assert c.status == RequestStatus.PREEMPTED and a.num_preemptions == b.num_preemptions == 0
    assert so.finished_req_ids == ["c"] and set(so.num_scheduled_tokens) == {"a", "b"}
    assert sched.running == [a, b]
    for out in run(sched, runner).values():
        merge(merged, out)
    assert {rid: out.new_token_ids for rid, out in merged.items()} == {
        rid: greedy(prompts[rid], 4) for rid in "abc"}


def test_a_preempted_request_waits_behind_better_priorities_queued_after_it():
    sched, runner, _, _, _ = _preemption_case("priority")
    sched.add_request(make("urgent", 8, priority=-1, max_tokens=1))
    sched.add_request(make("later", 8, priority=3, max_tokens=1))
    assert [r.request_id for r in sched.waiting] == ["urgent", "a", "later"]


# ---- the queue ----------------------------------------------------------------------------


def test_priority_queue_remove_and_abort_keep_the_order():
    requests = [make(f"r{i}", 4, priority=p, arrival=float(i))
                for i, p in enumerate([3, 1, 2, 1, 0, 2])]
    queue = PriorityWaitingQueue(requests)
    expected = sorted(requests, key=priority_key)
    assert list(queue) == expected and queue[0] is expected[0] and len(queue) == 6
    queue.remove(requests[2])
    expected.remove(requests[2])
    assert list(queue) == expected
    with pytest.raises(ValueError):
        queue.remove(requests[2])
    assert [queue.popleft() for _ in range(len(queue))] == expected and not queue

    sched = make_scheduler(max_num_seqs=1)
    for request in requests:
        sched.add_request(request)
    sched.abort_requests(["r4", "r0"])
    assert isinstance(sched.waiting, PriorityWaitingQueue)
    assert [r.request_id for r in sched.waiting] == ["r1", "r3", "r2", "r5"]
    assert admission_order(sched, make_runner(sched)) == ["r1", "r3", "r2", "r5"]


# ---- property: the priorities change the order, never the tokens -------------------------

VOCAB = 30
request_specs = st.tuples(
    st.integers(-2, 2),  # priority
    st.integers(1, 30),  # prompt tokens
    st.integers(1, 30),  # max_tokens (prompt + max_tokens stays within max_model_len)
)
step_events = st.tuples(
    st.lists(request_specs, max_size=3),  # arrivals before this step
    st.lists(st.integers(0, 60), max_size=1),  # aborts: indexes into all requests so far
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    num_blocks=st.integers(3, 10),
    max_num_seqs=st.integers(1, 5),
    extra_budget=st.integers(0, 40),
    in_flight=st.sampled_from([1, 2]),
    events=st.lists(step_events, min_size=1, max_size=40),
)
def test_every_request_finishes_with_the_same_tokens_whatever_the_priorities(
        num_blocks, max_num_seqs, extra_budget, in_flight, events):
    sched = make_scheduler(num_blocks=num_blocks, block_size=8, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_seqs + extra_budget,
                           max_model_len=64)
    runner = make_runner(sched, vocab_size=VOCAB)
    prompts, max_tokens, merged, ids = {}, {}, {}, []
    pending: deque = deque()

    def one_step():
        so = sched.schedule()
        check_invariants(sched)
        keys = [priority_key(r) for r in sched.running]
        assert keys == sorted(keys), "running out of priority order"
        if so.scheduled_new_reqs and sched.waiting:  # nobody admitted past a better one
            worst_admitted = max(priority_key(sched.requests[new.req_id])
                                 for new in so.scheduled_new_reqs)
            assert worst_admitted <= priority_key(sched.waiting[0])
        victims = [sched.requests[rid] for rid in so.finished_req_ids if rid in sched.requests
                   and sched.requests[rid].status == RequestStatus.PREEMPTED]
        if victims and sched.running:  # preemption took the worst priorities
            assert min(map(priority_key, victims)) >= keys[-1]
        pending.append((so, runner.execute(so)))

    def update():
        for out in sched.update_from_output(*pending.popleft()):
            merge(merged, out)
        check_invariants(sched)

    for arrivals, aborts in events:
        for priority, num_prompt, num_out in arrivals:
            rid = f"r{len(ids)}"
            ids.append(rid)
            prompt = [(len(ids) * 7 + i) % (VOCAB - 1) + 1 for i in range(num_prompt)]
            try:
                sched.add_request(make(rid, prompt, priority, arrival=float(len(ids)),
                                       max_tokens=num_out, ignore_eos=True))
            except ValueError:  # can never fit in this pool
                assert -(-(num_prompt + num_out) // 8) > num_blocks
                continue
            prompts[rid], max_tokens[rid] = prompt, num_out
        for i in aborts:
            if i < len(ids):
                for out in sched.abort_requests([ids[i]]):
                    merge(merged, out)
        if sched.has_unfinished_requests():
            one_step()
        if len(pending) >= in_flight:
            update()
    for _ in range(3000):  # drain
        if not sched.has_unfinished_requests():
            break
        one_step()
        if len(pending) >= in_flight:
            update()
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    event(f"preemptions: {'yes' if sched.num_preemptions else 'no'}")
    event(f"distinct priorities: {len({spec[0] for a, _ in events for spec in a})}")
    while pending:
        update()
    assert merged.keys() == prompts.keys(), "a request neither finished nor aborted"
    for rid, out in merged.items():
        expected = greedy(prompts[rid], max_tokens[rid], VOCAB)
        if out.finish_reason == "abort":
            assert out.new_token_ids == expected[:len(out.new_token_ids)], rid
        else:
            assert (out.new_token_ids, out.finish_reason) == (expected, "length"), rid
