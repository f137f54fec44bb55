"""Router: the data-parallel frontend's choice of replica, against hand-computed cases."""

import random

import pytest

from echo.engine.router import (
    PREFIX_INDEX_SEGMENTS,
    ROUTING_POLICIES,
    NoReplicaError,
    PrefixIndex,
    Router,
    block_hashes,
)

BLOCK = 16
SEGMENTS = PREFIX_INDEX_SEGMENTS  # the generations of each replica's prefix index


def tokens(seed: int, n: int) -> list[int]:
    """n token ids that share nothing with another seed's (ids are offset by seed)."""
    rng = random.Random(seed)
    return [seed * 100_000 + rng.randrange(50_000) for _ in range(n)]


# round_robin


def test_round_robin_alternates_and_skips_an_unavailable_replica():
    router = Router(2, "round_robin")
    assert [router.choose([1, 2, 3]) for _ in range(4)] == [0, 1, 0, 1]
    assert router.in_flight == [2, 2]

    router = Router(3, "round_robin")
    router.set_available(1, False)
    assert [router.choose([1]) for _ in range(4)] == [0, 2, 0, 2]
    router.set_available(1, True)  # back in its turn, in index order
    assert [router.choose([1]) for _ in range(3)] == [0, 1, 2]


# least_load


def test_least_load_picks_fewer_in_flight_then_fewer_waiting_then_lower_kv_usage_then_index():
    router = Router(2, "least_load")
    assert router.choose([1]) == 0  # all equal: lowest index
    assert router.choose([1]) == 1  # 0 has one in flight
    assert router.choose([1]) == 0  # [1, 1]: lowest index
    assert router.in_flight == [2, 1]
    router.finished(0)
    assert router.in_flight == [1, 1]

    # in-flight tie: fewer waiting wins, whatever the kv usage
    router.update_stats(0, num_running=5, num_waiting=3, kv_cache_usage=0.1)
    router.update_stats(1, num_running=5, num_waiting=2, kv_cache_usage=0.9)
    assert router.choose([1]) == 1
    router.finished(1)
    # in-flight and waiting tie: lower kv usage wins
    router.update_stats(1, num_running=5, num_waiting=3, kv_cache_usage=0.5)
    assert router.choose([1]) == 0
    router.finished(0)
    # everything equal: lowest index
    router.update_stats(1, num_running=5, num_waiting=3, kv_cache_usage=0.1)
    assert router.choose([1]) == 0


def test_in_flight_dominates_the_reported_stats():
    router = Router(2, "least_load")
    router.update_stats(0, num_running=0, num_waiting=0, kv_cache_usage=0.0)
    router.update_stats(1, num_running=50, num_waiting=40, kv_cache_usage=0.99)
    assert router.choose([1]) == 0
    # one in flight on 0, none on 1: the frontend's own count decides, not the reports
    assert router.choose([1]) == 1
    # [1, 1]: now the reports break the tie
    assert router.choose([1]) == 0


def test_finished_never_goes_below_zero_and_checks_its_index():
    router = Router(2, "least_load")
    router.finished(1)
    assert router.in_flight == [0, 0]
    with pytest.raises(ValueError, match="index"):
        router.finished(2)
    with pytest.raises(ValueError, match="index"):
        router.update_stats(-1, 0, 0, 0.0)


# cache_aware


def test_prompts_sharing_a_long_prefix_follow_the_first_of_their_group():
    router = Router(2)  # cache_aware
    groups = [tokens(g + 1, 256) for g in range(10)]  # 16 blocks each
    # the groups interleaved: request j of every group, then request j + 1 of every group
    home: dict[int, int] = {}
    followed = 0
    for j in range(8):
        for g, prefix in enumerate(groups):
            prompt = prefix + tokens(1000 + g * 8 + j, 100)  # a tail of 6 full blocks + 4
            if j == 0:
                home[g] = router.choose(prompt)
                continue
            assert router.matched_blocks(prompt, None, home[g]) == 16
            assert router.matched_blocks(prompt, None, 1 - home[g]) == 0
            followed += router.choose(prompt) == home[g]
    # the first of each group finds nothing cached and is balanced: 0, 1, 0, 1, ...
    assert [home[g] for g in range(10)] == [0, 1] * 5
    # 5 groups per replica keep the loads within 1 of each other, far under the threshold
    assert followed == 70
    assert router.in_flight == [40, 40]


def test_unrelated_prompts_spread_by_in_flight_count():
    router = Router(2)
    chosen = [router.choose(tokens(500 + i, 300)) for i in range(41)]
    assert chosen == [0, 1] * 20 + [0]
    assert router.in_flight == [21, 20]

    # finished requests free their replica: the next unrelated prompt goes where fewer are left
    for _ in range(5):
        router.finished(1)
    assert router.choose(tokens(999, 300)) == 1
    assert abs(router.in_flight[0] - router.in_flight[1]) > 1  # 21 vs 16: not yet balanced
    picks = [router.choose(tokens(2000 + i, 300)) for i in range(6)]
    assert picks == [1, 1, 1, 1, 1, 0]  # 21-16 -> 21-17 ... -> 21-21, then the tie goes to 0
    assert router.in_flight == [22, 21]


def test_the_balance_threshold_overrides_the_match_when_its_replica_is_overloaded():
    router = Router(2, balance_abs_threshold=2)
    prompt = tokens(7, 64)  # 4 blocks
    # 0 holds the prefix; it keeps it while in_flight[0] - in_flight[1] <= 2, i.e. up to 3
    # in flight; the 4th goes to 1, which then holds it too and, less loaded, wins the ties
    # on match length until the loads are equal again, when the lower index wins
    picks = [router.choose(prompt) for _ in range(7)]
    assert picks == [0, 0, 0, 1, 1, 1, 0]
    assert router.in_flight == [4, 3]
    assert router.matched_blocks(prompt, None, 1) == 4


def test_a_prompt_shorter_than_one_block_falls_back_to_least_load():
    router = Router(2)
    long_prompt = tokens(3, 64)
    assert router.choose(long_prompt) == 0
    # the same first 15 tokens: no full block, so no match; 1 has fewer in flight
    assert router.choose(long_prompt[:15]) == 1
    assert router.matched_blocks(long_prompt[:15], None, 0) == 0
    assert router.index_size(1) == 0  # nothing was inserted for it
    assert router.index_size(0) == 4


def test_cache_salt_separates_otherwise_equal_prompts():
    router = Router(2)
    prompt = tokens(4, 80)  # 5 blocks
    assert router.choose(prompt, cache_salt="a") == 0
    assert router.choose(prompt, cache_salt="b") == 1  # no match under "b": least loaded
    assert router.choose(prompt, cache_salt="a") == 0  # loads equal, 0 matches under "a"
    assert router.matched_blocks(prompt, "a", 0) == 5
    assert router.matched_blocks(prompt, "b", 0) == 0
    assert router.matched_blocks(prompt, None, 0) == 0
    assert router.matched_blocks(prompt, "b", 1) == 5
    assert block_hashes(prompt, BLOCK, "a") != block_hashes(prompt, BLOCK, "b")


def test_an_unavailable_replica_loses_its_index_and_is_never_chosen():
    router = Router(2)
    prompt = tokens(5, 128)  # 8 blocks
    assert router.choose(prompt) == 0
    assert router.matched_blocks(prompt, None, 0) == 8
    router.update_stats(0, num_running=1, num_waiting=4, kv_cache_usage=0.5)
    router.set_available(0, False)
    assert router.available == [1]
    assert router.index_size(0) == 0
    assert router.matched_blocks(prompt, None, 0) == 0
    assert router.in_flight == [0, 0]
    assert router.stats[0].num_waiting == 0
    # its prefix no longer pulls anything there, and neither does its zero load
    assert [router.choose(prompt) for _ in range(3)] == [1, 1, 1]
    router.set_available(0, True)
    assert router.available == [0, 1]
    assert router.matched_blocks(prompt, None, 0) == 0  # rejoined with an empty cache
    assert router.choose(prompt) == 1  # 1 now holds it, 3 - 0 in flight is within 8
    assert router.choose(tokens(6, 64)) == 0  # unrelated: the idle replica


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_choose_never_returns_an_unavailable_replica(policy):
    rng = random.Random(0)
    router = Router(4, policy, balance_abs_threshold=2)
    prefixes = [tokens(10 + i, 64) for i in range(3)]
    for step in range(400):
        if step % 25 == 0:
            index = rng.randrange(4)
            router.set_available(index, not router._is_available[index] or
                                 len(router.available) == 1)
        prompt = rng.choice(prefixes) + tokens(100 + step, rng.randrange(40))
        index = router.choose(prompt)
        assert index in router.available
        if rng.random() < 0.5:
            router.finished(rng.choice(router.available))
    for index in range(4):
        if index not in router.available:
            assert router.in_flight[index] == 0
            assert router.index_size(index) == 0


@pytest.mark.parametrize("policy", ROUTING_POLICIES)
def test_no_replica_available_raises(policy):
    router = Router(2, policy)
    router.set_available(0, False)
    router.set_available(1, False)
    assert router.available == []
    with pytest.raises(NoReplicaError, match="no replica is available"):
        router.choose(tokens(1, 32))


def test_the_prefix_index_evicts_whole_generations_oldest_first():
    """PrefixIndex by hand: capacity 12 in 3 sets of 4, chains of plain ints."""
    index = PrefixIndex(12, segments=3)
    assert (index.capacity, index.segment_capacity, index.max_segments) == (12, 4, 3)
    index.insert([1, 2], 0)  # A = {1, 2}
    index.insert([5, 6], 0)  # A = {1, 2, 5, 6}: full
    index.insert([7, 8], 0)  # B = {7, 8}, A
    assert len(index) == 6
    # [1, 2] held, 3 new: 3 goes into B, then 2 is touched (moved from A into B), then 1 finds B
    # full and starts C: C = {1}, B = {2, 3, 7, 8}, A = {5, 6}; a parent never older than its child
    assert index.matched([1, 2, 3]) == 2
    index.insert([1, 2, 3], 2)
    assert len(index) == 7
    assert [index.matched(chain) for chain in ([1, 2, 3], [5, 6], [7, 8])] == [3, 2, 2]
    # 4 new hashes, the tail first: 10, 11, 12 fill C, 9 starts D, which drops A, the oldest
    index.insert([9, 10, 11, 12], 0)
    assert len(index) == 9
    assert [index.matched(chain) for chain in ([1, 2, 3], [5, 6], [7, 8], [9, 10, 11, 12])] \
        == [3, 0, 2, 4]
    # again: D = {9, 14, 15, 16}, then E = {13} drops B = {2, 3, 7, 8}: of the chain 1, 2, 3
    # only its head survives, in C, and the match stops there
    index.insert([13, 14, 15, 16], 0)
    assert len(index) == 9
    assert [index.matched(chain) for chain in ([1, 2, 3], [7, 8], [9, 10, 11, 12],
                                                [13, 14, 15, 16])] == [1, 0, 4, 4]
    assert 2 not in index and 1 in index
    index.clear()
    assert len(index) == 0 and index.matched([9, 10]) == 0


def test_the_prefix_index_never_holds_more_than_its_capacity_freed_or_not():
    """Dropped generations are freed a few hundred hashes per insert: held and not yet freed
    together stay within the capacity, and they are all freed in the end."""
    index = PrefixIndex(4096, segments=4)  # sets of 1,024
    rng = random.Random(2)
    for step in range(400):
        chain = [step * 1000 + k for k in range(rng.randrange(1, 300))]
        index.insert(chain, 0)
        assert len(index) + sum(map(len, index._retired)) <= 4096
        assert len(index) <= 4096
    index.clear()  # a replica that left: its hashes are freed by the next inserts
    assert len(index) == 0
    assert sum(map(len, index._retired)) <= 4096
    for step in range(40):
        index.insert([10**9 + step], 0)
    assert index._retired == []
    assert len(index) == 40


def test_the_prefix_index_is_bounded_per_replica_and_keeps_the_most_recent_prompts():
    # sets of 10 hashes, one 10-block prompt each: the index keeps the last SEGMENTS prompts
    bound = 10 * SEGMENTS
    router = Router(1, max_blocks_per_replica=bound)
    prompts = [tokens(20 + i, 160) for i in range(3 * SEGMENTS)]  # 10 blocks each, nothing shared
    for prompt in prompts:
        router.choose(prompt)
        assert router.index_size(0) <= bound
    assert router.index_size(0) == bound
    matched = [router.matched_blocks(p, None, 0) for p in prompts]
    assert matched == [0] * 2 * SEGMENTS + [10] * SEGMENTS

    # a bound that is not a multiple of the sets' count is rounded down, never exceeded
    router = Router(1, max_blocks_per_replica=50)
    for prompt in prompts:
        router.choose(prompt)
        assert router.index_size(0) <= 50
    assert router.index_size(0) == 50 // SEGMENTS * SEGMENTS

    # a prompt longer than the bound keeps its head, not its tail
    router = Router(1, max_blocks_per_replica=bound)
    long_prompt = tokens(60, 25 * SEGMENTS * BLOCK)
    router.choose(long_prompt)
    assert router.index_size(0) == bound
    assert router.matched_blocks(long_prompt, None, 0) == bound

    # routing a prompt again makes it the most recent: the next new prompt evicts the one
    # routed after it, the oldest now
    router = Router(1, max_blocks_per_replica=bound)
    first, *others = prompts[:SEGMENTS]
    for prompt in (first, *others, first, prompts[SEGMENTS]):
        router.choose(prompt)
    assert router.matched_blocks(first, None, 0) == 10
    assert router.matched_blocks(others[0], None, 0) == 0
    assert [router.matched_blocks(p, None, 0) for p in others[1:]] == [10] * (SEGMENTS - 2)
    assert router.matched_blocks(prompts[SEGMENTS], None, 0) == 10


@pytest.mark.parametrize("bound", [40, 97, 400])
def test_matched_blocks_equals_a_linear_count_under_eviction(bound):
    """The binary search in matched_blocks relies on each index being prefix-closed; check it
    against the plain count of leading hashes found, with prompts sharing prefixes of every
    length and an index small enough to evict all the time."""
    rng = random.Random(1)
    router = Router(3, balance_abs_threshold=1, max_blocks_per_replica=bound)
    trunks = [tokens(200 + i, 24 * BLOCK) for i in range(4)]
    for step in range(300):
        trunk = rng.choice(trunks)
        prompt = trunk[:rng.randrange(len(trunk))] + tokens(300 + step, rng.randrange(100))
        router.choose(prompt)
        if rng.random() < 0.6:
            router.finished(rng.randrange(3))
        probe = rng.choice(trunks)[:rng.randrange(24 * BLOCK)]
        hashes = block_hashes(probe, BLOCK)
        for index in range(3):
            linear = 0
            for h in hashes:
                if h not in router._indexes[index]:
                    break
                linear += 1
            assert router.matched_blocks(probe, None, index) == linear
            assert router.index_size(index) <= bound


@pytest.mark.parametrize("kwargs, name", [
    ({"policy": "random"}, "policy"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"num_replicas": 2.0}, "num_replicas"),
    ({"block_size": 0}, "block_size"),
    ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
    ({"max_blocks_per_replica": 0}, "max_blocks_per_replica"),
])
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    kwargs = {"num_replicas": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        Router(**kwargs)


def test_the_engine_arguments_offer_the_routers_policies():
    from echo.config import ROUTER_POLICIES
    from echo.engine.router import ROUTING_POLICIES

    assert ROUTER_POLICIES == ROUTING_POLICIES
