"""The KV cache manager's host tier: stores on free, loads at admission, pins while copies are
in flight, exact accounting (check_invariants) across both tiers, hand-computed block ids."""

import pytest

from echo.core.host_tier import HostTier
from echo.core.kv_cache_manager import KVCacheManager
from tests.core.test_kv_cache_manager import BS, admit, req


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
    transfers, released = kv.take_transfers(7)
    assert transfers.stores == [(0, 0), (1, 1)] and transfers.loads == [] and released == []
    # pinned: the two stored blocks are held by their copy, the partial one is free
    assert kv.pool.ref_counts[:3] == [1, 1, 0]
    kv.check_invariants()
    kv.transfers_done([7])
    assert kv.pool.ref_counts[:3] == [0, 0, 0] and kv.stored_blocks == 2
    assert kv.host.num_valid == 2
    assert kv.take_transfers(8) == (None, [7])  # the workers learn it was seen done
    kv.check_invariants()
    # the same prefix again: already on the host, nothing stored twice
    run_to_end(kv, req("b", list(range(10))))
    assert kv.take_transfers(9) == (None, [])


def test_a_prefix_evicted_from_the_gpu_is_loaded_from_the_host():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(12))  # three full blocks
    run_to_end(kv, req("a", prompt))
    transfers, _ = kv.take_transfers(1)
    assert transfers.stores == [(0, 0), (1, 1), (2, 2)]
    kv.transfers_done([1])
    # another prompt takes every GPU block: a's cached blocks are evicted
    run_to_end(kv, req("x", list(range(100, 116))))
    transfers, _ = kv.take_transfers(2)
    assert len(transfers.stores) == 4  # x's own blocks go to the host too
    kv.transfers_done([2])
    assert kv.get_computed_blocks(req("probe", prompt + [5])).num_tokens == 0
    # a's prefix plus one token: 3 blocks found on the host are loaded into fresh GPU blocks
    b = req("b", prompt + [5])
    computed = kv.get_computed_blocks(b)
    assert kv.start_load(b, computed) and kv.is_loading(b)
    assert kv.host_queries == 3 * BS and kv.host_hits == 3 * BS
    transfers, _ = kv.take_transfers(3)
    assert [h for h, _ in transfers.loads] == [0, 1, 2]
    loaded = [d for _, d in transfers.loads]
    kv.check_invariants()
    kv.transfers_done([3])
    assert not kv.is_loading(b) and kv.loaded_blocks == 3
    # now the GPU prefix cache has them: admission reuses them instead of computing
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == loaded and computed.num_tokens == 12
    assert not kv.start_load(b, computed)
    assert kv.allocate_slots(b, 1, computed) is not None
    kv.check_invariants()


def test_an_abort_during_a_load_frees_everything():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(8))
    run_to_end(kv, req("a", prompt))
    kv.take_transfers(1)
    kv.transfers_done([1])
    run_to_end(kv, req("x", list(range(50, 66))))  # evicts a's blocks from the GPU
    kv.take_transfers(2)
    kv.transfers_done([2])
    b = req("b", prompt + [1])
    assert kv.start_load(b, kv.get_computed_blocks(b))
    kv.take_transfers(3)
    kv.free(b)  # aborted while its load is in flight: the load still holds its blocks
    kv.check_invariants()
    kv.transfers_done([3])
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
    assert kv.take_transfers(0) == (None, [])
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
        assert len(second.kv_stores) == 2 and second.kv_transfers_before_step
    else:
        assert second.kv_stores == [] and not second.kv_transfers_before_step
    sched.kv.check_invariants()


def test_a_prefix_cache_reset_forgets_the_host_tier_too():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    prompt = list(range(8))
    run_to_end(kv, req("a", prompt))
    kv.take_transfers(1)
    assert not kv.reset_prefix_cache()  # a copy is in flight
    kv.transfers_done([1])
    assert kv.reset_prefix_cache() and kv.host.num_valid == 0
    b = req("b", prompt + [1])
    assert not kv.start_load(b, kv.get_computed_blocks(b))  # stale KV is not loaded
    kv.check_invariants()
