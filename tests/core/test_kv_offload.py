"""The KV cache manager's host tier: stores on free, loads at admission, pins while copies are
in flight, exact accounting (check_invariants) across both tiers, hand-computed block ids."""

import pytest

from echo.core.host_tier import HostTier
from echo.core.kv_cache_manager import KVCacheManager
from echo.core.sched_output import KVTransfer
from tests.core.test_kv_cache_manager import BS, admit, req


def take_one(kv: KVCacheManager) -> KVTransfer:
    """The one transfer the next step carries."""
    transfers, _ = kv.take_transfers()
    assert len(transfers) == 1
    return transfers[0]


def run_to_end(kv: KVCacheManager, request) -> list[int]:
    """Admit a request, compute all its tokens and free it (finished); its block ids."""
    assert admit(kv, request) is not None
    blocks = kv.get_block_ids(request)
    kv.free(request)
    return blocks


def test_a_finished_requests_full_blocks_are_stored_and_pinned_until_done():
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=4)
    a = req("a", list(range(10)))  # two full blocks and a partial one
    assert run_to_end(kv, a) == [0, 1, 2]
    transfers, released = kv.take_transfers()
    assert transfers == [KVTransfer(0, [(0, 0), (1, 1)], [], False)] and released == []
    # pinned: the two stored blocks are held by their copy, the partial one is free
    assert kv.pool.ref_counts[:3] == [1, 1, 0]
    kv.check_invariants()
    kv.transfers_done([0])
    assert kv.pool.ref_counts[:3] == [0, 0, 0] and kv.stored_blocks == 2
    assert kv.host.num_valid == 2
    assert kv.take_transfers() == ([], [0])  # the workers learn it was seen done
    kv.check_invariants()
    # the same prefix again: already on the host, nothing stored twice
    run_to_end(kv, req("b", list(range(10))))
    assert kv.take_transfers() == ([], [])


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_host():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(12))  # three full blocks
    run_to_end(kv, req("a", prompt))
    transfer = take_one(kv)
    assert transfer.stores == [(0, 0), (1, 1), (2, 2)]
    kv.transfers_done([transfer.transfer_id])
    # another prompt takes every GPU block: a's cached blocks are evicted
    run_to_end(kv, req("x", list(range(100, 116))))
    transfer = take_one(kv)
    assert len(transfer.stores) == 4  # x's own blocks go to the host too
    kv.transfers_done([transfer.transfer_id])
    assert kv.get_computed_blocks(req("probe", prompt + [5])).num_tokens == 0
    # a's prefix plus one token: 3 blocks found on the host are loaded into fresh GPU blocks
    b = req("b", prompt + [5])
    computed = kv.get_computed_blocks(b)
    assert kv.start_load(b, computed) and kv.is_loading(b)
    assert kv.host_queries == 3 * BS and kv.host_hits == 3 * BS
    transfer = take_one(kv)
    assert [h for h, _ in transfer.loads] == [0, 1, 2] and transfer.stores == []
    loaded = [d for _, d in transfer.loads]
    kv.check_invariants()
    kv.transfers_done([transfer.transfer_id])
    assert not kv.is_loading(b) and kv.loaded_blocks == 3
    # now the GPU prefix cache has them: admission reuses them instead of computing
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == loaded and computed.num_tokens == 12
    assert not kv.start_load(b, computed)
    assert kv.allocate_slots(b, 1, computed) is not None
    kv.check_invariants()


def test_each_request_loads_in_a_transfer_of_its_own_and_is_admitted_once_its_own_landed(
        monkeypatch):
    """Two requests loading at once: the first may run while the second's blocks still move
    (one transfer for both would hold the first until every block had landed). Each one's wait
    is counted from the step that took its load to the report that it landed."""
    clock = iter([5.0, 5.25, 6.0])  # the loads' step, the first landing, the second
    kv = KVCacheManager(num_blocks=5, block_size=BS, num_host_blocks=10)
    first_prompt, second_prompt = list(range(8)), list(range(20, 28))  # two full blocks each
    for rid, prompt, host_ids in (("a", first_prompt, [0, 1]), ("c", second_prompt, [2, 3]),
                                  ("x", list(range(100, 120)), [4, 5, 6, 7, 8])):
        run_to_end(kv, req(rid, prompt))  # x takes every GPU block: a's and c's are evicted
        store = take_one(kv)
        assert [h for _, h in store.stores] == host_ids
        kv.transfers_done([store.transfer_id])
    b1, b2 = req("b1", first_prompt + [1]), req("b2", second_prompt + [1])
    assert kv.start_load(b1, kv.get_computed_blocks(b1))
    assert kv.start_load(b2, kv.get_computed_blocks(b2))
    monkeypatch.setattr("echo.core.kv_cache_manager.monotonic", lambda: next(clock))
    transfers, released = kv.take_transfers()
    assert released == [2]  # the stores seen done since the last step
    assert [(t.transfer_id, [h for h, _ in t.loads], t.stores) for t in transfers] == [
        (3, [0, 1], []), (4, [2, 3], [])]
    kv.transfers_done([3])
    assert not kv.is_loading(b1) and kv.is_loading(b2)
    computed = kv.get_computed_blocks(b1)
    assert computed == ([d for _, d in transfers[0].loads], 8)
    assert kv.allocate_slots(b1, 1, computed) == [4]  # b1 runs; b2's blocks stay held
    kv.check_invariants()
    assert kv.take_transfers() == ([], [3])
    kv.transfers_done([4])
    assert not kv.is_loading(b2) and kv.loaded_blocks == 4
    assert kv.loads_done == 2 and kv.load_wait_seconds == 0.25 + 1.0
    assert kv.get_computed_blocks(b2).block_ids == [d for _, d in transfers[1].loads]
    kv.check_invariants()


def test_write_back_stores_a_cached_block_only_when_an_allocation_evicts_it():
    """4 GPU blocks of 4 tokens. a (10 tokens) finishes: nothing is stored, its two full blocks
    stay cached (freed last-first: block 1 is evicted before block 0). x (16 tokens) takes the
    plain blocks 2 and 3, then evicts 1 and 0: each is copied to the host first, unpinned, and
    the step waits for it (before_step). b repeats a's prefix: loading it evicts x's first two
    blocks (0, 1), whose write-backs go ahead of the load into the same blocks."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8, write_back=True)
    assert run_to_end(kv, req("a", list(range(10)))) == [0, 1, 2]
    assert kv.take_transfers() == ([], [])
    x = req("x", list(range(100, 116)))
    assert admit(kv, x) == [2, 3, 1, 0]
    assert kv.take_transfers() == ([KVTransfer(0, [(1, 0), (0, 1)], [], True)], [])
    kv.check_invariants()  # unpinned: the write-backs hold no reference
    kv.transfers_done([0])
    assert kv.host.num_valid == 2 and kv.stored_blocks == 2
    kv.free(x)
    b = req("b", list(range(10)) + [5])
    assert kv.start_load(b, kv.get_computed_blocks(b))
    transfers, released = kv.take_transfers()
    assert released == [0]
    # a's block 0 went to host block 1 and its block 1 to host block 0
    assert transfers == [KVTransfer(1, [(0, 2), (1, 3)], [], True),
                         KVTransfer(2, [], [(1, 0), (0, 1)], False)]
    kv.check_invariants()
    kv.transfers_done([1, 2])
    computed = kv.get_computed_blocks(b)
    assert computed == ([0, 1], 8) and kv.host.num_valid == 4
    kv.check_invariants()


def test_an_abort_during_a_load_frees_everything():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(8))
    run_to_end(kv, req("a", prompt))
    kv.transfers_done([take_one(kv).transfer_id])
    run_to_end(kv, req("x", list(range(50, 66))))  # evicts a's blocks from the GPU
    kv.transfers_done([take_one(kv).transfer_id])
    b = req("b", prompt + [1])
    assert kv.start_load(b, kv.get_computed_blocks(b))
    load = take_one(kv)
    kv.free(b)  # aborted while its load is in flight: the load still holds its blocks
    kv.check_invariants()
    kv.transfers_done([load.transfer_id])
    kv.check_invariants()
    assert kv.num_free_blocks == 4 and kv.host.num_valid >= 2


def test_a_full_host_tier_evicts_its_least_recently_used_block_but_never_a_pinned_one():
    tier = HostTier(2)
    first, second = tier.start_store(b"h1"), tier.start_store(b"h2")
    assert (first, second) == (0, 1)
    assert tier.start_store(b"h3") is None  # both are still being stored
    tier.finish_store(first)
    tier.finish_store(second)
    assert tier.lookup(b"h1") == 0  # h1 is now the most recently used
    tier.pin(0)  # a load reads h1's block
    assert tier.start_store(b"h3") == 1  # h2 goes, not the pinned h1
    assert b"h2" not in tier and b"h3" in tier and tier.lookup(b"h1") == 0
    tier.finish_store(1)
    tier.unpin(0)
    tier.check()
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier(0)


def test_without_a_host_tier_nothing_changes():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run_to_end(kv, req("a", list(range(10))))
    assert kv.take_transfers() == ([], [])
    assert kv.pool.ref_counts == [0] * 8
    assert not kv.start_load(req("b", list(range(10))), kv.get_computed_blocks(
        req("b", list(range(10)))))
    kv.check_invariants()


def swap_scheduler(mode: str):
    from echo.config import CacheConfig, SchedulerConfig
    from echo.core.scheduler import Scheduler

    cache = CacheConfig(block_size=8, kv_offloading_size=1.0 if mode == "swap" else None,
                        preemption_mode=mode)
    return Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64,
                                     max_model_len=512), cache, 4, num_host_blocks=64)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_swap_preempts_one_request_like_recompute_and_orders_the_step_after_its_copy(mode):
    """4 blocks of 8: a and b hold two each; a's 17th token needs a fifth block. Preempting b
    is enough in both modes: a swap frees b's blocks at once (its copy is ordered before the
    step that reuses them, on the device) instead of pinning them."""
    from tests.core.scheduler_helpers import make_request, make_runner

    sched = swap_scheduler(mode)
    runner = make_runner(sched)
    sched.add_request(make_request("a", 16, max_tokens=4))
    sched.add_request(make_request("b", 16, max_tokens=4))
    first = sched.schedule()
    sched.update_from_output(first, runner.execute(first))
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 1} and sched.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["b"]
    if mode == "swap":  # b's two full blocks are copied out before the step reuses one
        [swap] = second.kv_transfers
        assert len(swap.stores) == 2 and swap.loads == [] and swap.before_step
    else:
        assert second.kv_transfers == []
    sched.kv.check_invariants()


def test_a_prefix_cache_reset_forgets_the_host_tier_too():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(8))
    run_to_end(kv, req("a", prompt))
    store = take_one(kv)
    assert not kv.reset_prefix_cache()  # a copy is in flight
    kv.transfers_done([store.transfer_id])
    assert kv.reset_prefix_cache() and kv.host.num_valid == 0
    b = req("b", prompt + [1])
    assert not kv.start_load(b, kv.get_computed_blocks(b))  # stale KV is not loaded
    kv.check_invariants()


def test_a_load_is_joined_only_into_blocks_free_since_before_the_step_in_flight():
    """A load may start beside the step in flight (joined, KVTransfer.ordered False) only when
    none of its blocks was freed after the step before it was planned: the one in flight may use
    those. It takes such blocks first, passing over a block freed just now."""
    kv = KVCacheManager(num_blocks=12, block_size=BS, num_host_blocks=24,
                        joined_load_max_blocks=128)
    prefixes = [list(range(12)), list(range(40, 52)), list(range(60, 72))]  # 3 blocks each
    for i, prompt in enumerate([*prefixes, list(range(100, 148))]):
        run_to_end(kv, req(f"r{i}", prompt))  # the last takes all 12 GPU blocks: evicts the rest
        kv.transfers_done([take_one(kv).transfer_id])  # its blocks are free from this epoch
    b1 = req("b1", prefixes[0] + [1])
    assert kv.start_load(b1, kv.get_computed_blocks(b1))
    (load1,), _ = kv.take_transfers()
    assert len(load1.loads) == 3 and load1.ordered  # its blocks were freed in this very step
    kv.take_transfers()  # one more step planned: the blocks left were free before it began
    b2 = req("b2", prefixes[1] + [1])
    assert kv.start_load(b2, kv.get_computed_blocks(b2))
    (load2,), _ = kv.take_transfers()
    assert len(load2.loads) == 3 and not load2.ordered
    # a request freed now leaves a plain block (its partial one) that the usual order would
    # hand out first; the load passes it over for blocks free since earlier
    y = req("y", list(range(200, 206)))
    assert admit(kv, y) is not None
    fresh = kv.get_block_ids(y)[1]
    kv.free(y)
    b3 = req("b3", prefixes[2] + [1])
    assert kv.start_load(b3, kv.get_computed_blocks(b3))
    transfers, _ = kv.take_transfers()  # b3's load before y's store, which waits on the device
    load3, store = transfers
    assert len(load3.loads) == 3 and not load3.ordered
    assert store.stores and not store.loads and store.ordered
    assert fresh not in {d for _, d in load3.loads}
    loaded = [{d for _, d in t.loads} for t in (load1, load2, load3)]
    assert sum(map(len, loaded)) == len(set().union(*loaded)) == 9
    kv.check_invariants()


def test_a_joined_load_into_blocks_a_swap_out_reads_stays_after_it():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8, write_back=True,
                        joined_load_max_blocks=128)
    prompt = list(range(8))  # two full blocks
    run_to_end(kv, req("a", prompt))  # write-back: nothing stored while its blocks stay cached
    assert kv.take_transfers() == ([], [])
    run_to_end(kv, req("x", list(range(100, 116))))  # evicts a's blocks: swapped out
    kv.transfers_done([take_one(kv).transfer_id])
    kv.take_transfers()
    kv.take_transfers()  # x's cached blocks are free since before the step in flight
    b = req("b", prompt + [1])
    assert kv.start_load(b, kv.get_computed_blocks(b))
    swap, load = kv.take_transfers()[0]  # the swap-out of the blocks the load evicted first
    assert swap.before_step and [d for d, _ in swap.stores] == [d for _, d in load.loads]
    assert not load.ordered  # free since long enough, but queued behind the swap all the same
    kv.check_invariants()


def _evicted_to_host(kv: KVCacheManager, prompt: list[int], filler: list[int]) -> None:
    """Run `prompt` (written through to the host), then `filler`, which takes every GPU block;
    two more plans go by, so the blocks are free since before the step in flight."""
    for tokens in (prompt, filler):
        run_to_end(kv, req(f"run{tokens[0]}", tokens))
        kv.transfers_done([take_one(kv).transfer_id])
    kv.take_transfers()
    kv.take_transfers()


@pytest.mark.parametrize("joined_limit", [0, 2], ids=["without early loads", "past the limit"])
def test_a_load_not_joined_waits_for_the_steps_before_it_and_for_its_report(joined_limit):
    """Without early loads (limit 0), or a load of three blocks past a limit of 2."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8,
                        joined_load_max_blocks=joined_limit)
    prompt = list(range(12))  # three blocks to load
    _evicted_to_host(kv, prompt, list(range(100, 116)))
    b = req("b", prompt + [5])
    assert kv.start_load(b, kv.get_computed_blocks(b)) and kv.is_loading(b)
    load = take_one(kv)
    assert load.ordered and not load.before_step


def test_a_small_settled_load_is_joined_and_its_request_admitted_in_the_step_that_loads_it():
    """Early loads: the request finds its prefix through the loading blocks at once and is
    admitted with them; the plan makes the step wait for the load on the device. The load keeps
    its own reference until reported done, and its wait is not counted."""
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8,
                        joined_load_max_blocks=128)
    prompt = list(range(12))  # three full blocks
    _evicted_to_host(kv, prompt, list(range(100, 116)))
    b = req("b", prompt + [5])
    assert kv.get_computed_blocks(b).num_tokens == 0
    assert kv.start_load(b, kv.get_computed_blocks(b)) and not kv.is_loading(b)
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 12 and len(computed.block_ids) == 3
    assert admit(kv, b) is not None
    assert kv.get_block_ids(b)[:3] == computed.block_ids
    load = take_one(kv)
    assert not load.ordered and load.before_step
    assert [d for _, d in load.loads] == computed.block_ids
    assert [kv.pool.ref_counts[d] for d in computed.block_ids] == [2, 2, 2]  # b and the load
    kv.check_invariants()
    kv.transfers_done([load.transfer_id])
    assert [kv.pool.ref_counts[d] for d in computed.block_ids] == [1, 1, 1]
    assert (kv.loads_done, kv.loads_joined, kv.load_wait_seconds) == (1, 1, 0.0)
    kv.check_invariants()


def test_a_joined_request_freed_before_its_load_lands_leaves_the_blocks_to_the_load():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8,
                        joined_load_max_blocks=128)
    prompt = list(range(12))
    _evicted_to_host(kv, prompt, list(range(100, 116)))
    b = req("b", prompt + [5])
    assert kv.start_load(b, kv.get_computed_blocks(b)) and not kv.is_loading(b)
    kv.free(b)  # aborted before admission: the hold goes, the load's reference stays
    load = take_one(kv)
    assert [kv.pool.ref_counts[d] for _, d in load.loads] == [1, 1, 1]
    kv.check_invariants()
    kv.transfers_done([load.transfer_id])
    assert kv.pool.num_free_blocks == 4
    c = req("c", prompt + [6])  # cached all the same
    assert kv.get_computed_blocks(c).num_tokens == 12
    kv.check_invariants()


def test_a_load_behind_copies_in_flight_is_not_joined():
    """The joined limit counts the copies queued before the load on the workers' side stream:
    a store not yet seen done is one."""
    kv = KVCacheManager(num_blocks=8, block_size=BS, num_host_blocks=16,
                        joined_load_max_blocks=4)
    prompt = list(range(12))  # three blocks to load
    _evicted_to_host(kv, prompt, list(range(100, 132)))
    run_to_end(kv, req("y", list(range(200, 208))))  # two blocks stored, in flight
    store = take_one(kv)
    kv.take_transfers()
    b = req("b", prompt + [5])
    assert kv.start_load(b, kv.get_computed_blocks(b)) and kv.is_loading(b)  # 3 + 2 > 4
    load = take_one(kv)
    assert load.ordered and not load.before_step
    kv.transfers_done([store.transfer_id, load.transfer_id])
    assert kv.loads_joined == 0
    kv.check_invariants()


def test_the_scheduler_takes_early_loads_and_their_joined_limit_from_the_environment(
        monkeypatch):
    monkeypatch.delenv("ECHO_KV_JOINED_LOAD_BLOCKS", raising=False)
    monkeypatch.setenv("ECHO_KV_EARLY_LOADS", "1")
    kv = swap_scheduler("swap").kv
    assert kv.joined_load_max_blocks == 128
    monkeypatch.setenv("ECHO_KV_JOINED_LOAD_BLOCKS", "7")
    assert swap_scheduler("swap").kv.joined_load_max_blocks == 7
    monkeypatch.setenv("ECHO_KV_EARLY_LOADS", "0")  # off: nothing joins, whatever the limit
    assert swap_scheduler("swap").kv.joined_load_max_blocks == 0
