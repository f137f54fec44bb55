"""Several decode steps per launch (num_scheduler_steps) in the scheduler, with the fake runner
computing every step (its KV check catches a slot written or read outside the request's
blocks): when a launch runs N steps, how the tokens left and the pool shorten it, and outputs
equal to one step per launch under async scheduling, stops, preemption and prefix caching."""

import random

import pytest

from tests.core.scheduler_helpers import (
    EOS,
    make_request,
    make_runner,
    make_scheduler,
    run,
    scripted,
    step,
)


def test_steps_by_hand():
    sched = make_scheduler(num_scheduler_steps=4)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 14, max_tokens=10))  # token limit 24
    so, outs = step(sched, runner)  # the prompt: one step
    assert (so.num_decode_steps, len(outs[0].new_token_ids)) == (1, 1)
    # 15 tokens, 14 computed: positions 14..17 in one launch, the second block allocated now
    so, outs = step(sched, runner)
    assert so.num_decode_steps == 4 and so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.new_block_ids == [[1]]
    assert len(outs[0].new_token_ids) == 4 and sched.requests["a"].num_computed_tokens == 18
    so, outs = step(sched, runner)  # 19 tokens: 4 more
    assert so.num_decode_steps == 4 and len(outs[0].new_token_ids) == 4
    so, outs = step(sched, runner)  # 23 tokens, one left
    assert so.num_decode_steps == 1 and outs[0].finish_reason == "length"
    assert sched.kv.usage == 0


def test_one_step_while_a_request_waits_or_needs_the_host():
    sched = make_scheduler(num_scheduler_steps=4, max_num_seqs=1)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 4, max_tokens=20))
    sched.add_request(make_request("b", 4, max_tokens=20))
    step(sched, runner)
    assert step(sched, runner)[0].num_decode_steps == 1  # b waits for a's seat
    sched = make_scheduler(num_scheduler_steps=4)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 4, max_tokens=20))
    sched.add_request(make_request("p", 4, max_tokens=20, repetition_penalty=1.2))
    step(sched, runner)
    assert step(sched, runner)[0].num_decode_steps == 1  # penalties count tokens on the host


def test_one_step_when_the_pool_lacks_the_blocks_of_more():
    sched = make_scheduler(num_blocks=4, num_scheduler_steps=8)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 30, max_tokens=18))
    sched.add_request(make_request("b", 17, max_tokens=15))
    step(sched, runner)  # the prompts take all four blocks
    for _ in range(2):  # positions 30, 31 and 17, 18 fit; 8 steps would need a fifth block
        so, _ = step(sched, runner)
        assert so.num_decode_steps == 1 and sched.num_preemptions == 0


def test_a_stop_inside_a_launch_ends_the_request_there():
    sched = make_scheduler(num_scheduler_steps=8)
    prompt_lens = {"a": 5}
    runner = make_runner(sched, next_token=scripted({"a": [3, 4, 5, EOS, 6, 6]}, prompt_lens))
    sched.add_request(make_request("a", 5, max_tokens=30))
    outputs = run(sched, runner, in_flight=2)
    assert outputs["a"].new_token_ids == [3, 4, 5, EOS] and outputs["a"].finish_reason == "stop"
    assert sched.kv.usage == 0 and not sched.requests


@pytest.mark.parametrize("seed", range(6))
def test_outputs_equal_one_step_per_launch(seed):
    """Random prompts, lengths and EOS scripts, a pool small enough to preempt, shared
    prefixes, two steps in flight: the same outputs with 1 and with 5 steps per launch."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 1000) for _ in range(20)]
    requests, scripts, prompt_lens = [], {}, {}
    for i in range(12):
        rid = f"r{i}"
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, 1000)
                                                           for _ in range(rng.randrange(1, 40))]
        prompt_lens[rid] = len(prompt)
        if rng.random() < 0.4:  # an EOS somewhere in its output
            scripts[rid] = [rng.randrange(1, 1000) for _ in range(rng.randrange(0, 20))] + [EOS]
        requests.append((rid, prompt, rng.randrange(1, 40)))
    results = []
    for steps in (1, 5):
        sched = make_scheduler(num_blocks=24, max_num_seqs=6, num_scheduler_steps=steps)
        runner = make_runner(sched, next_token=scripted(scripts, prompt_lens))
        for rid, prompt, max_tokens in requests:
            sched.add_request(make_request(rid, list(prompt), max_tokens=max_tokens))
        outputs = run(sched, runner, in_flight=2)
        assert sched.kv.usage == 0 and not sched.requests
        results.append({rid: (o.new_token_ids, o.finish_reason) for rid, o in outputs.items()})
    assert results[0] == results[1]
