"""Property test: random arrivals, lengths, shared prefixes, aborts and tiny block pools, one or
two steps in flight, for thousands of steps in all, without and with a host tier (stores,
loads, swaps and write-back). After every schedule() and every update_from_output() the block
pool and the request queues must be consistent; at the end every request has finished or been
aborted, nothing leaks, and every output equals the greedy reference computed directly (so
preemption, chunking, caching and the host tier never change a token). The FakeModelRunner
also checks every KV slot it reads against the token sequence that wrote it, and that no
unordered load fills a block the step before it used; with early loads, a joined request reads
its loaded blocks in the very step that loads them."""

import os
from collections import Counter, deque
from unittest import mock

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from echo.core.request import RequestStatus
from echo.core.scheduler import Scheduler
from tests.core.fake_runner import default_next_token

from .scheduler_helpers import EOS, make_request, make_runner, make_scheduler, merge

VOCAB = 30  # small, so EOS (0) and the stop token turn up by themselves
STOP_TOKEN = 29
PREFIXES = [[], list(range(100, 108)), list(range(200, 216)), list(range(300, 324))]

request_specs = st.tuples(
    st.integers(0, len(PREFIXES) - 1),  # shared prefix
    st.integers(1, 40),  # own prompt tokens
    st.integers(1, 40),  # max_tokens
    st.integers(0, 3),  # min_tokens
    st.booleans(),  # ignore_eos
    st.booleans(),  # stop on STOP_TOKEN
    st.sampled_from([None, "tenant"]),  # cache salt
).filter(lambda spec: spec[3] <= spec[2])  # SamplingParams refuses min_tokens > max_tokens
step_events = st.tuples(
    st.lists(request_specs, max_size=2),  # arrivals before this step
    st.lists(st.integers(0, 40), max_size=1),  # aborts: indexes into all requests so far
    st.booleans(),  # abort while the step is in flight (else before it is scheduled)
)


def reference(prompt: list[int], spec: tuple, max_model_len: int) -> tuple[list[int], str]:
    _, _, max_tokens, min_tokens, ignore_eos, stop, _ = spec
    limit = min(len(prompt) + max_tokens, max_model_len)
    out: list[int] = []
    while True:
        token = default_next_token(prompt + out, VOCAB)
        out.append(token)
        if len(out) >= min_tokens:
            if (token == EOS and not ignore_eos) or (stop and token == STOP_TOKEN):
                return out, "stop"
        if len(prompt) + len(out) >= limit:
            return out, "length"


def check_invariants(sched: Scheduler) -> None:
    pool, kv = sched.kv.pool, sched.kv
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert all(pool.ref_counts[b] == 0 for b in free), "a block both free and in use"
    assert len(free) + sum(1 for r in pool.ref_counts if r > 0) == pool.num_blocks
    tables = kv.tracked_block_tables()
    if kv.host is None:
        users = Counter(b for table in tables.values() for b in table)
        assert all(pool.ref_counts[b] == users[b] for b in range(pool.num_blocks))
    else:  # copies in flight and loaded blocks awaiting admission hold references too
        kv.check_invariants()
    for b, h in enumerate(pool.block_hashes):
        assert h is None or pool.get_cached_block(h) == b
    assert pool.num_cached_blocks() == sum(h is not None for h in pool.block_hashes)

    running = {r.request_id for r in sched.running}
    waiting = {r.request_id for r in sched.waiting}
    assert len(running) == len(sched.running) <= sched.max_num_seqs
    assert not running & waiting and running | waiting == sched.requests.keys()
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
               for r in sched.waiting)
    assert all(not tables.get(rid) for rid in waiting), "a waiting request holds blocks"
    assert tables.keys() <= sched.requests.keys()
    for r in sched.running:
        assert len(tables[r.request_id]) * sched.block_size >= r.num_computed_tokens


workloads = dict(
    block_size=st.sampled_from([8, 16]),
    num_blocks=st.integers(3, 12),
    max_num_seqs=st.integers(1, 6),
    extra_budget=st.integers(0, 58),
    max_model_len=st.integers(24, 96),
    in_flight=st.sampled_from([1, 2, 3]),
    threshold_share=st.sampled_from([None, 1, 2, 4]),
    events=st.lists(step_events, min_size=10, max_size=80),
)
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(prefix_caching=st.booleans(), **workloads)
def test_random_workloads_keep_every_invariant(prefix_caching, **workload):
    run_workload(prefix_caching=prefix_caching, **workload)


@SETTINGS
@given(num_host_blocks=st.integers(1, 24), policy=st.sampled_from(["write_through", "write_back"]),
       swap=st.booleans(), transfer_delay=st.integers(0, 2), early_loads=st.booleans(),
       joined_limit=st.sampled_from([2, 128, 128]), **workloads)
def test_random_workloads_with_a_host_tier_keep_every_invariant(num_host_blocks, policy, swap,
                                                               transfer_delay, early_loads,
                                                               joined_limit, **workload):
    """joined_limit: with early loads, 2 joins some (loads and the copies ahead of them are a
    few blocks here), 128 nearly all."""
    host_tier = {"kv_offloading_policy": policy,
                 "preemption_mode": "swap" if swap else "recompute"}
    switches = {"ECHO_KV_EARLY_LOADS": "1" if early_loads else "0",
                "ECHO_KV_JOINED_LOAD_BLOCKS": str(joined_limit)}
    with mock.patch.dict(os.environ, switches):
        run_workload(prefix_caching=True, num_host_blocks=num_host_blocks, host_tier=host_tier,
                     transfer_delay=transfer_delay, **workload)


def run_workload(block_size, num_blocks, max_num_seqs, extra_budget, max_model_len,
                 prefix_caching, in_flight, threshold_share, events, transfer_delay=0, **host):
    budget = max_num_seqs + extra_budget
    threshold = None if threshold_share is None else max(1, budget // threshold_share)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           max_model_len=max_model_len, prefix_caching=prefix_caching,
                           long_prefill_token_threshold=threshold, **host)
    runner = make_runner(sched, vocab_size=VOCAB, transfer_delay=transfer_delay)
    specs, prompts, ids, merged, steps = {}, {}, [], {}, []
    pending: deque = deque()

    def arrive(spec) -> None:
        prefix, own, max_tokens, min_tokens, ignore_eos, stop, salt = spec
        rid = f"r{len(ids)}"
        prompt = PREFIXES[prefix] + [(len(ids) * 7 + i) % 90 + 1 for i in range(own)]
        request = make_request(rid, prompt, max_tokens=max_tokens, min_tokens=min_tokens,
                               ignore_eos=ignore_eos,
                               stop_token_ids=[STOP_TOKEN] if stop else [])
        request.cache_salt = salt
        ids.append(rid)
        kv_tokens = min(len(prompt) + max_tokens, max_model_len)
        fits = (len(prompt) <= max_model_len
                and -(-max(kv_tokens, len(prompt)) // block_size) <= num_blocks)
        try:
            sched.add_request(request)
        except ValueError:
            assert not fits, f"{rid} fits but was rejected"
            return
        assert fits, f"{rid} can never fit but was accepted"
        specs[rid], prompts[rid] = spec, prompt

    def abort(indexes) -> None:
        for i in indexes:
            if i < len(ids):
                for out in sched.abort_requests([ids[i]]):
                    merge(merged, out)
        check_invariants(sched)

    def one_step() -> None:
        decodes = [r for r in sched.running
                   if r.num_tokens + r.num_output_placeholders == r.num_computed_tokens + 1
                   and r.num_tokens + r.num_output_placeholders
                   < min(r.num_prompt_tokens + r.max_tokens, max_model_len)]
        so = sched.schedule()
        assert so.total_num_scheduled_tokens <= budget
        assert len(so.num_scheduled_tokens) <= max_num_seqs
        for r in decodes:  # never starved by prefills; only preemption stops a decode
            assert r.request_id in so.num_scheduled_tokens or r.status == RequestStatus.PREEMPTED
        check_invariants(sched)
        pending.append((so, runner.execute(so)))
        steps.append(so.total_num_scheduled_tokens)

    def update() -> None:
        for out in sched.update_from_output(*pending.popleft()):
            merge(merged, out)
        check_invariants(sched)

    for arrivals, aborts, abort_in_flight in events:
        for spec in arrivals:
            arrive(spec)
        if not abort_in_flight:
            abort(aborts)
        one_step()
        if abort_in_flight:
            abort(aborts)
        if len(pending) >= in_flight:
            update()

    for _ in range(2000):  # drain: no more arrivals or aborts
        if not sched.has_unfinished_requests():
            break
        one_step()
        if len(pending) >= in_flight:
            update()
    assert not sched.has_unfinished_requests(), "requests left unfinished"
    event(f"preemptions: {'yes' if sched.num_preemptions else 'no'}")
    event(f"steps: {len(steps) // 50 * 50}+")
    if sched.kv.host is not None:
        loads = ("joined ones" if sched.kv.loads_joined else
                 "ordered only" if runner.loads else "none")
        event(f"loads: {loads}")
    while pending:
        update()
    for _ in range(transfer_delay + 3):  # the workers forget the last finished requests; the
        # copies land
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
        if not sched.kv.transfers_pending:
            break
    assert not sched.kv.transfers_pending
    check_invariants(sched)

    assert sched.kv.num_free_blocks == num_blocks
    assert sched.kv.num_tracked_requests() == 0
    assert not sched.running and not sched.waiting and not runner.requests
    assert merged.keys() == specs.keys(), "a request neither finished nor aborted"
    for rid, out in merged.items():
        expected, reason = reference(prompts[rid], specs[rid], max_model_len)
        if out.finish_reason == "abort":
            assert out.new_token_ids == expected[: len(out.new_token_ids)]
        else:
            assert (out.new_token_ids, out.finish_reason) == (expected, reason), rid
