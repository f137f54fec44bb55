import pytest

from echo.core.block_pool import BlockPool


def h(n: int) -> bytes:
    return n.to_bytes(32, "little")


def test_allocate_takes_lowest_ids_and_sets_one_reference():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.ref_counts == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    assert pool.num_used_blocks == 3
    assert pool.usage == 0.75


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="only 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_free_returns_plain_blocks_once_unreferenced():
    pool = BlockPool(3)
    ids = pool.allocate(2)
    pool.touch([ids[0]])  # a second user
    pool.free(ids)
    assert pool.ref_counts == [1, 0, 0]
    assert sorted(pool.free_block_ids()) == [1, 2]
    pool.free([ids[0]])
    assert pool.num_free_blocks == 3


def test_free_more_than_allocated_raises():
    pool = BlockPool(2)
    ids = pool.allocate(1)
    pool.free(ids)
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free(ids)


def test_cached_block_survives_free_and_is_found_by_hash():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.cache_block(b, h(7))
    pool.free([b])
    assert pool.ref_counts[b] == 0
    assert pool.get_cached_block(h(7)) == b
    pool.touch([b])  # a prefix hit takes it back off the free list
    assert pool.ref_counts[b] == 1
    assert b not in pool.free_block_ids()
    assert pool.num_free_blocks == 3


def test_allocation_prefers_plain_blocks_over_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, h(1))
    pool.free([a])
    pool.free([b])  # plain
    assert pool.allocate(1) == [b]
    assert pool.get_cached_block(h(1)) == a


def test_eviction_is_lru_and_a_sequence_tail_goes_first():
    pool = BlockPool(6)
    seq1 = pool.allocate(3)  # 0 1 2
    seq2 = pool.allocate(3)  # 3 4 5
    for i, block_id in enumerate(seq1 + seq2):
        pool.cache_block(block_id, h(i))
    pool.free(seq1)  # released 2, 1, 0
    pool.free(seq2)  # released 5, 4, 3
    assert pool.free_block_ids() == [2, 1, 0, 5, 4, 3]
    assert pool.allocate(2) == [2, 1]
    # evicted blocks lose their hash; the rest are still findable
    assert pool.get_cached_block(h(2)) is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(0)) == 0
    assert not pool.is_cached(2)
    assert pool.num_cached_blocks() == 4


def test_a_block_reused_and_freed_again_becomes_most_recently_used():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, block_id in enumerate(ids):
        pool.cache_block(block_id, h(i))
    pool.free([0])
    pool.free([1])
    pool.free([2])
    pool.touch([0])
    pool.free([0])  # freed again: now the most recently used
    assert pool.free_block_ids() == [1, 2, 0]


def test_duplicate_hash_leaves_second_block_plain():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(9))
    pool.cache_block(b, h(9))
    assert pool.get_cached_block(h(9)) == a
    assert not pool.is_cached(b)


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    [a] = pool.allocate(1)
    pool.cache_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.free([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(1)) == a
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h(1)) is None
    assert pool.num_cached_blocks() == 0
    assert pool.allocate(3) == [0, 1, 2]


def test_free_since_tells_blocks_free_before_an_epoch_from_those_freed_in_it():
    pool = BlockPool(6)
    assert pool.free_since(range(6), 0)  # never used: free since the start
    a = pool.allocate(2)
    assert a == [0, 1]
    pool.epoch = 3
    pool.free(a)  # both become free in epoch 3
    assert pool.free_since([0, 1], 4) and not pool.free_since([0, 1], 3)
    assert pool.free_since([2], 0)
    b = pool.allocate(1)  # the sequence's head, freed last, goes out first
    assert b == [0]
    pool.epoch = 5
    pool.free(b)
    assert pool.free_since([1], 4) and not pool.free_since([0], 5) and pool.free_since([0], 6)
    # a block with two users becomes free only when the last lets go
    pool.touch(pool.allocate(1))  # block 0 again, twice referenced
    pool.epoch = 7
    pool.free([0])
    assert pool.free_since([0], 6)  # still in use: its stamp is from epoch 5
    pool.epoch = 8
    pool.free([0])
    assert not pool.free_since([0], 8) and pool.free_since([0], 9)


def test_allocate_settled_before_takes_blocks_free_since_before_that_epoch_first():
    pool = BlockPool(6)
    a = pool.allocate(4)  # [0, 1, 2, 3]; 4 and 5 never used
    pool.cache_block(0, b"h0")
    pool.cache_block(1, b"h1")
    pool.epoch = 2
    pool.free([a[0]])  # block 0: cached, free from epoch 2
    pool.epoch = 4
    pool.free(a[1:])  # block 1 cached; 3, then 2 plain (a sequence's tail first), epoch 4
    # plain now, latest first: 2, 3, 4, 5 (never used); cached, least recent first: 0, 1
    assert pool.allocate(1) == [2]  # the usual order: the latest plain block
    pool.free([2])  # plain again, freed in epoch 4
    # before epoch 3: plain blocks freed longest ago (5, 4), then cached in LRU order (0);
    # then the rest as usual (2, the latest plain)
    assert pool.allocate(4, settled_before=3) == [5, 4, 0, 2]
    assert pool.get_cached_block(b"h0") is None  # evicted: it was taken
    assert pool.free_block_ids() == [3, 1]
