from echo.core.kv_cache_manager import KVCacheManager, hash_block, root_hash
from echo.core.request import Request
from echo.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def admit(kv: KVCacheManager, request: Request, num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: reuse its prefix, allocate the rest."""
    computed = kv.get_computed_blocks(request)
    if num_new is None:
        num_new = request.num_tokens - computed.num_tokens
    blocks = kv.allocate_slots(request, num_new, computed)
    if blocks is not None:
        request.num_computed_tokens = computed.num_tokens + num_new
    return blocks


def test_allocate_slots_grows_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = req("a", list(range(6)))
    assert kv.allocate_slots(r, 6) == [0, 1]
    r.num_computed_tokens = 6
    r.append_output_token_ids([100])
    assert kv.allocate_slots(r, 1) == []  # token 7 fits in block 1
    r.num_computed_tokens = 7
    r.append_output_token_ids([101])
    assert kv.allocate_slots(r, 1) == []  # token 8 fills block 1
    r.num_computed_tokens = 8
    r.append_output_token_ids([102])
    assert kv.allocate_slots(r, 1) == [2]
    assert kv.get_block_ids(r) == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a, b = req("a", list(range(8))), req("b", list(range(50, 58)))
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.get_block_ids(b) == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots(b, 4) == [2]


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    system = list(range(8))  # two full blocks
    a = req("a", system + [20, 21, 22])
    b = req("b", system + [30])
    assert admit(kv, a) == [0, 1, 2]
    computed = kv.get_computed_blocks(b)
    assert computed.block_ids == [0, 1]
    assert computed.num_tokens == 8
    assert admit(kv, b) == [3]
    assert kv.get_block_ids(b) == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    # queries count every token looked up at admission, hits the reused ones
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (11 + 9, 0 + 8)


def test_never_reuses_the_whole_prompt():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a, b = req("a", list(range(8))), req("b", list(range(8)))
    admit(kv, a)
    computed = kv.get_computed_blocks(b)
    assert computed.num_tokens == 4  # the last token must be computed again for its logits
    assert admit(kv, b) == [2]
    assert b.num_computed_tokens == 8


def test_prefix_stops_at_first_differing_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]))
    # block 1 differs, so block 2 cannot be reused even though its tokens match
    b = req("b", [1, 2, 3, 4, 0, 6, 7, 8, 9, 10, 11, 12, 13])
    assert kv.get_computed_blocks(b).block_ids == [0]


def test_cache_salt_separates_identical_prompts():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, req("a", list(range(9)), salt="tenant-1"))
    assert kv.get_computed_blocks(req("b", list(range(9)), salt="tenant-2")).num_tokens == 0
    assert kv.get_computed_blocks(req("c", list(range(9)))).num_tokens == 0
    assert kv.get_computed_blocks(req("d", list(range(9)), salt="tenant-1")).num_tokens == 8


def test_block_hashes_chain_over_parent_and_tokens():
    root = root_hash(None)
    first = hash_block(root, [1, 2, 3, 4])
    assert hash_block(root, [1, 2, 3, 4]) == first
    assert hash_block(first, [1, 2, 3, 4]) != first
    assert hash_block(root, [1, 2, 3, 5]) != first
    assert root_hash("s") != root


def test_generated_tokens_are_cached_too():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", [1, 2, 3])
    admit(kv, a)
    for token in (4, 5, 6):  # decode: the sampled token is computed in the next step
        a.append_output_token_ids([token])
        kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    # tokens 1..4 are known and computed: block 0 is cached; 5, 6 are not a full block yet
    b = req("b", [1, 2, 3, 4, 5, 6])
    assert kv.get_computed_blocks(b).block_ids == [0]


def test_placeholder_tokens_are_not_cached_before_they_are_known():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = req("a", [1, 2, 3])
    # scheduled to compute 4 tokens while only 3 are known (async: one is a placeholder)
    kv.allocate_slots(a, 4)
    assert kv.pool.num_cached_blocks() == 0


def test_free_releases_everything_and_keeps_the_cache():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    assert kv.get_block_ids(a) == []
    assert kv.num_tracked_requests() == 0
    # the two full blocks stay cached; the partial third one does not
    assert kv.pool.num_cached_blocks() == 2
    b = req("b", list(range(9)))
    assert admit(kv, b) == [2]
    assert kv.get_block_ids(b) == [0, 1, 2]
    assert kv.usage == 0.75


def test_reusing_free_cached_blocks_counts_them_against_capacity():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = req("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # blocks 0, 1 cached and free
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54])  # reuses 0, 1; needs 2 more
    assert admit(kv, b) is None
    assert kv.pool.ref_counts == [0, 0, 0]
    assert kv.prefix_cache_queries == 8  # a failed admission is not counted
    c = req("c", list(range(8)) + [50, 51])  # reuses 0, 1; needs 1 more
    assert admit(kv, c) == [2]
    assert kv.pool.ref_counts == [1, 1, 1]


def test_caching_disabled_finds_nothing_and_counts_nothing():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    admit(kv, req("a", list(range(9))))
    b = req("b", list(range(9)))
    assert kv.get_computed_blocks(b).num_tokens == 0
    assert admit(kv, b) == [3, 4, 5]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)
