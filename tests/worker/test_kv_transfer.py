"""The KV host tier's copies: blocks stored to host memory and loaded back are bit-exact in every
layer's K, V and int8 scales, and no other device block changes, whether a chunk goes through the
staging buffer or moves by strided copies ("direct": on the CPU the same strided copies row by
row, so their addresses and pitches are checked here)."""

import time

import pytest
import torch

from echo.worker.kv_cache import KVCacheSpec
from echo.worker.kv_transfer import COPY_MODES, HostKVCache, KVTransfers, host_tier_blocks

CPU = torch.device("cpu")
NUM_BLOCKS = 12
DTYPES = [(torch.bfloat16, "auto"), (torch.float32, "auto"), (torch.bfloat16, "int8")]


def spec(model_dtype=torch.bfloat16, kv_cache_dtype="auto", **shape) -> KVCacheSpec:
    # odd sizes, so a wrong byte range or stride does not line up by accident
    shape = {"num_layers": 3, "block_size": 4, "num_kv_heads": 3, "head_dim": 5, **shape}
    return KVCacheSpec(**shape, model_dtype=model_dtype, kv_cache_dtype=kv_cache_dtype)


def parts(caches) -> list[torch.Tensor]:
    return [p for c in caches for p in (c.k, c.v, c.k_scale, c.v_scale) if p is not None]


def random_cache(kv_spec: KVCacheSpec, device=CPU, num_blocks=NUM_BLOCKS):
    """A cache of random values (scales too, so a block or head mixed up in the strided scale
    layout shows), its per-layer views, and a copy of every tensor."""
    stacked = kv_spec.allocate_stacked(num_blocks, device)
    caches = stacked.layers
    for p in parts(caches):
        if p.dtype == torch.int8:
            p.copy_(torch.randint(-128, 128, p.shape, dtype=torch.int8, device=device))
        else:
            p.copy_(torch.randn(p.shape, device=device))
    return stacked, caches, [p.clone() for p in parts(caches)]


def setup(kv_spec, num_host_blocks=6, chunk=64, copy_mode="staged"):
    stacked, caches, originals = random_cache(kv_spec)
    host = HostKVCache(kv_spec, num_host_blocks, pin=False)
    return caches, originals, host, KVTransfers(stacked, host, CPU, chunk, copy_mode=copy_mode)


def round_trip(xfer, caches, stored, host_ids, loaded_into):
    xfer.start(1, stored, host_ids, [], [])
    assert xfer.poll_done() == [1]
    xfer.release([1])
    for p in parts(caches):
        p[stored] = 0
    xfer.start(2, [], [], host_ids, loaded_into)
    assert xfer.poll_done() == [2]
    xfer.release([2])


def assert_moved(caches, originals, moves: dict[int, int], zeroed=()):
    """Device block moves[src] now holds src's original values, blocks in zeroed are zero, every
    other block is unchanged."""
    for p, orig in zip(parts(caches), originals):
        for src, dst in moves.items():
            assert torch.equal(p[dst], orig[src]), (src, dst)
        for block in range(p.shape[0]):
            if block in moves.values():
                continue
            expected = torch.zeros_like(orig[block]) if block in zeroed else orig[block]
            assert torch.equal(p[block], expected), block


@pytest.mark.parametrize("copy_mode", ["staged", "direct"])
@pytest.mark.parametrize("model_dtype, kv_cache_dtype", DTYPES)
def test_store_then_load_into_other_blocks_is_bit_exact(model_dtype, kv_cache_dtype, copy_mode):
    kv_spec = spec(model_dtype, kv_cache_dtype)
    caches, originals, host, xfer = setup(kv_spec, copy_mode=copy_mode)
    round_trip(xfer, caches, [3, 7, 1], [0, 5, 2], [9, 2, 4])
    assert_moved(caches, originals, {3: 9, 7: 2, 1: 4}, zeroed={3, 7, 1})
    bpb = kv_spec.bytes_per_block()
    assert xfer.bytes_moved == (3 * bpb, 3 * bpb)
    assert xfer.seconds >= 0


@pytest.mark.parametrize("copy_mode", ["staged", "direct"])
def test_a_host_block_is_the_device_blocks_bytes_layer_by_layer(copy_mode):
    kv_spec = spec(torch.bfloat16, "int8")
    caches, originals, host, xfer = setup(kv_spec, copy_mode=copy_mode)
    xfer.start(1, [3], [4], [], [])
    # layer 0's K, V, layer 1's K, V ..., then layer 0's K and V scales ... in their stored
    # [heads, block_size] order
    kv = [p[3] for layer in range(3) for p in originals[4 * layer:4 * layer + 2]]
    scales = [p[3].transpose(0, 1) for layer in range(3)
              for p in originals[4 * layer + 2:4 * layer + 4]]
    expected = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in kv + scales])
    assert torch.equal(host.data[4], expected)


@pytest.mark.parametrize("copy_mode", ["staged", "direct"])
@pytest.mark.parametrize("model_dtype, kv_cache_dtype", DTYPES)
def test_more_blocks_than_a_chunk_and_runs_of_host_ids(model_dtype, kv_cache_dtype, copy_mode):
    caches, originals, host, xfer = setup(spec(model_dtype, kv_cache_dtype), 8, chunk=2,
                                          copy_mode=copy_mode)
    # chunks [0, 5] [6, 10] [11]; host runs 3-4, then 5 | 0, 7 (a run split by a chunk)
    round_trip(xfer, caches, [0, 5, 6, 10, 11], [3, 4, 5, 0, 7], [1, 2, 3, 4, 7])
    assert_moved(caches, originals, {0: 1, 5: 2, 6: 3, 10: 4, 11: 7}, zeroed={0, 5, 6, 10, 11})


@pytest.mark.parametrize("copy_mode", ["staged", "direct"])
def test_one_transfer_stores_before_it_loads(copy_mode):
    caches, originals, host, xfer = setup(spec(kv_cache_dtype="int8"), copy_mode=copy_mode)
    # block 5 goes to host 1, which is loaded into block 6 within the same transfer
    xfer.start(1, [5, 8], [1, 0], [1], [6])
    assert_moved(caches, originals, {5: 6})
    xfer.start(2, [], [], [0], [10])
    assert_moved(caches, originals, {5: 6, 8: 10})


def test_poll_done_reports_each_transfer_once_oldest_first():
    caches, _, host, xfer = setup(spec())
    xfer.start(7, [1], [0], [], [])
    xfer.start(3, [2], [1], [], [])
    assert xfer.poll_done() == [7, 3]
    xfer.start(5, [], [], [0], [4])
    assert xfer.poll_done() == [5]
    assert xfer.poll_done() == []
    xfer.release([3])
    assert xfer.poll_done() == []
    xfer.wait_all()


def test_release_of_unknown_or_released_ids_is_harmless_and_frees_the_id():
    caches, originals, host, xfer = setup(spec())
    xfer.release([42])
    xfer.start(1, [3], [0], [], [])
    with pytest.raises(ValueError, match="transfer_id"):
        xfer.start(1, [4], [1], [], [])  # still pending
    xfer.release([1, 1])
    xfer.release([1])
    xfer.start(1, [], [], [0], [9])  # the id is free again
    assert xfer.poll_done() == [1]
    assert_moved(caches, originals, {3: 9})


def test_an_empty_transfer_completes():
    _, _, _, xfer = setup(spec())
    xfer.start(1, [], [], [], [])
    assert xfer.poll_done() == [1]
    assert xfer.bytes_moved == (0, 0)


@pytest.mark.parametrize("args, name", [
    (([1, 2], [0], [], []), "store_host_blocks"),
    (([], [], [0, 1], [2]), "load_device_blocks"),
    (([NUM_BLOCKS], [0], [], []), "store_device_blocks"),
    (([-1], [0], [], []), "store_device_blocks"),
    (([1], [6], [], []), "store_host_blocks"),
    (([1, 2], [0, 0], [], []), "store_host_blocks"),  # one host block written twice
    (([], [], [-1], [2]), "load_host_blocks"),
    (([], [], [0], [NUM_BLOCKS]), "load_device_blocks"),
    (([], [], [0, 1], [2, 2]), "load_device_blocks"),
    (([1], [0], [], [], False), "ordered"),  # a store reads KV that queued work wrote
])
def test_bad_arguments_name_the_argument_and_move_nothing(args, name):
    caches, originals, host, xfer = setup(spec())
    with pytest.raises(ValueError, match=name):
        xfer.start(1, *args)
    assert xfer.poll_done() == []
    assert all(torch.equal(p, o) for p, o in zip(parts(caches), originals))


def test_bad_construction_names_the_argument():
    kv_spec = spec()
    caches = kv_spec.allocate_stacked(4, CPU)
    other = HostKVCache(spec(num_layers=2), 2, pin=False)
    with pytest.raises(ValueError, match="host"):
        KVTransfers(caches, other, CPU)
    with pytest.raises(ValueError, match="max_blocks_per_chunk"):
        KVTransfers(caches, HostKVCache(kv_spec, 2, pin=False), CPU, max_blocks_per_chunk=0)
    with pytest.raises(ValueError, match="copy_mode"):
        KVTransfers(caches, HostKVCache(kv_spec, 2, pin=False), CPU, copy_mode="fast")
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostKVCache(kv_spec, -1, pin=False)


def test_host_cache_layout():
    kv_spec = spec(kv_cache_dtype="int8")
    host = HostKVCache(kv_spec, 5, pin=False)
    assert host.data.shape == (5, kv_spec.bytes_per_block()) and host.data.dtype == torch.uint8
    assert host.data.is_contiguous() and not host.pinned
    assert HostKVCache(kv_spec, 0, pin=False).data.shape == (0, kv_spec.bytes_per_block())


@pytest.mark.parametrize("gib, bytes_per_block, tp, blocks", [
    (1, 2**20, 2, 512),
    (1, 2**20, 1, 1024),
    (1.5, 2**20, 1, 1536),
    (10, 1536, 1, 10 * 2**30 // 1536),  # 6,990,506.67: rounded down
    (1, 3 * 2**20, 4, 85),  # 85.33
    (0.001, 2**20, 1, 1),  # 1.07 MiB
    (0.0009, 2**20, 1, 0),
    (0, 2**20, 1, 0),
])
def test_host_tier_blocks_by_hand(gib, bytes_per_block, tp, blocks):
    assert host_tier_blocks(gib, bytes_per_block, tp) == blocks


@pytest.mark.parametrize("args, name", [
    ((-1, 2**20, 1), "kv_offloading_size_gib"),
    ((float("nan"), 2**20, 1), "kv_offloading_size_gib"),
    ((1, 0, 1), "bytes_per_block"),
    ((1, 2**20, 0), "tp_size"),
])
def test_host_tier_blocks_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        host_tier_blocks(*args)


# ---- the GPU path -------------------------------------------------------------------------

_SPIN = 200_000_000  # GPU clock cycles torch.cuda._sleep spins: ~0.1 s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("copy_mode", COPY_MODES)
@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int8"])
def test_gpu_stores_wait_for_the_main_stream_and_release_orders_reuse(kv_cache_dtype,
                                                                      copy_mode):
    device = torch.device("cuda")
    kv_spec = spec(torch.bfloat16, kv_cache_dtype, num_layers=4, block_size=16, num_kv_heads=8,
                   head_dim=128)
    stacked, caches, _ = random_cache(kv_spec, device, num_blocks=64)
    host = HostKVCache(kv_spec, 16, pin=True)
    assert host.pinned and host.data.is_pinned()
    xfer = KVTransfers(stacked, host, device, max_blocks_per_chunk=2, copy_mode=copy_mode)
    torch.cuda.synchronize()

    # 1. blocks written on the main stream behind a long spin: a store that did not wait for
    # the main stream would copy the random values instead
    torch.cuda._sleep(_SPIN)
    for p in parts(caches):
        for value, block in enumerate([3, 7, 1, 5], start=1):
            p[block].fill_(value)
    expected = [p.clone() for p in parts(caches)]
    xfer.start(1, [3, 7, 1], [0, 5, 2], [], [])
    assert xfer.poll_done() == []  # still behind the spin: poll_done does not wait
    xfer.wait_all()
    assert xfer.poll_done() == [1]
    xfer.release([1])

    # 2. the stores' side stream spins before a store of block 5; released at once (as a TP
    # rank whose copies lag rank 0's report), so the main stream's overwrite waits for the
    # copy: without that wait it would zero block 5 before the store read it
    with torch.cuda.stream(xfer._store_stream):
        torch.cuda._sleep(_SPIN)
    xfer.start(2, [5], [7], [], [])
    xfer.release([2])
    for p in parts(caches):
        p[[3, 7, 1, 5]] = 0
    xfer.wait_all()
    assert xfer.poll_done() == []  # released before it was reported: never reported

    xfer.start(3, [], [], [0, 5, 2, 7], [9, 2, 4, 10])
    xfer.wait_all()
    assert xfer.poll_done() == [3]
    xfer.release([3])
    torch.cuda.synchronize()
    for p, e in zip(parts(caches), expected):
        for src, dst in zip([3, 7, 1, 5], [9, 2, 4, 10]):
            assert torch.equal(p[dst], e[src]), (src, dst)
        for block in (0, 6, 8, 63):
            assert torch.equal(p[block], e[block]), block
        assert not p[[3, 7, 1, 5]].any()
    bpb = kv_spec.bytes_per_block()
    assert xfer.bytes_moved == (3 * bpb, 4 * bpb) and xfer.seconds > 0


def gpu_transfers(copy_mode: str):
    """KVTransfers of 2-block chunks, 3 in flight, between 64 random device blocks and a 48-block
    pinned host tier: (transfers, the cache tensors, their values before any transfer)."""
    device = torch.device("cuda")
    kv_spec = spec(torch.bfloat16, "auto", num_layers=4, block_size=16, num_kv_heads=8,
                   head_dim=128)
    stacked, caches, expected = random_cache(kv_spec, device, num_blocks=64)
    host = HostKVCache(kv_spec, 48, pin=True)
    xfer = KVTransfers(stacked, host, device, max_blocks_per_chunk=2, chunks_in_flight=3,
                       copy_mode=copy_mode)
    return xfer, caches, expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_gpu_a_large_transfer_is_issued_a_few_chunks_at_a_time(copy_mode):
    xfer, caches, expected = gpu_transfers(copy_mode)
    torch.cuda.synchronize()

    # 20 chunks behind a spinning main stream: three queued, the rest issued by later polls
    torch.cuda._sleep(_SPIN)
    xfer.start(1, list(range(40)), list(range(40)), [], [])
    assert xfer.queued_chunks == 3
    assert xfer.poll_done() == [] and xfer.queued_chunks == 3
    torch.cuda.synchronize()
    polls = 1
    while (done := xfer.poll_done()) == []:
        polls += 1
        torch.cuda.synchronize()
        assert polls < 20, "the transfer's chunks were not issued by poll_done"
    assert done == [1] and polls >= 6  # three chunks per poll: 20 take seven
    xfer.release([1])

    # a load waited on before it was issued: wait_on_device issues all of it, and the main
    # stream's reads after the wait see the loaded values
    torch.cuda._sleep(_SPIN)
    xfer.start(2, [], [], list(range(40)), list(range(24, 64)))
    xfer.wait_on_device(2)
    loaded = [p[24:64].clone() for p in parts(caches)]
    xfer.release([2])
    torch.cuda.synchronize()
    for got, e in zip(loaded, expected):
        assert torch.equal(got, e[:40])
    assert xfer.poll_done() == []  # released before it was reported


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_split_streams_reuse_a_staging_slot_only_after_its_scatter():
    # the scatters' stream spins while the copy stream could run ahead: with 3 slots, chunk 4's
    # copy into chunk 1's slot must wait for chunk 1's scatter, or chunk 1 loads chunk 4's bytes
    xfer, caches, expected = gpu_transfers("split")
    xfer.start(1, list(range(40)), list(range(40)), [], [])
    xfer.wait_all()
    assert xfer.poll_done() == [1]
    xfer.release([1])
    with torch.cuda.stream(xfer._kernel_stream):
        torch.cuda._sleep(_SPIN)
    xfer.start(2, [], [], list(range(40)), list(range(24, 64)))
    xfer.wait_on_device(2)  # every chunk issued at once, past chunks_in_flight
    loaded = [p[24:64].clone() for p in parts(caches)]
    xfer.release([2])
    torch.cuda.synchronize()
    for got, e in zip(loaded, expected):
        assert torch.equal(got, e[:40])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_direct_swap_outs_do_not_wait_for_loads_and_loads_wait_for_them():
    """Direct mode: a store (a swap-out the next step waits for) is not queued behind a load on
    its way in, while a load into a block being stored waits for that store."""
    xfer, caches, expected = gpu_transfers("direct")
    xfer.start(1, list(range(8)), list(range(8)), [], [])  # blocks 0-7 to host 0-7
    xfer.wait_all()
    xfer.poll_done()
    xfer.release([1])
    with torch.cuda.stream(xfer._stream):  # the loads' stream is held back
        torch.cuda._sleep(_SPIN)
    xfer.start(2, [], [], [0, 1], [40, 41])
    xfer.start(3, [9], [20], [], [])  # block 9 out, while the load above still waits
    xfer.wait_on_device(3)
    torch.cuda.current_stream().synchronize()
    assert not xfer._pending[2].end.query(), "the store waited for the held-back load"
    # a store of block 10 then a load into block 10 (a swap-out's block reused in one step)
    xfer.start(4, [10], [21], [], [])
    xfer.start(5, [], [], [2], [10])
    xfer.wait_all()
    torch.cuda.synchronize()
    host = xfer.host.data
    for p, e in zip(parts(caches), expected):
        assert torch.equal(p[40], e[0]) and torch.equal(p[41], e[1])
        assert torch.equal(p[10], e[2])  # the load landed after the store read block 10
    bpb = xfer.host.bytes_per_block
    assert torch.equal(host[21], _block_bytes(expected, 10, bpb))
    assert torch.equal(host[20], _block_bytes(expected, 9, bpb))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("copy_mode", COPY_MODES)
def test_gpu_an_early_load_runs_beside_the_main_streams_work(copy_mode):
    """An unordered load (into blocks no queued work uses) lands while the main stream still
    spins, also when the stream's next work waits for it (a joined load); an ordered one
    waits for the spin."""
    xfer, caches, expected = gpu_transfers(copy_mode)
    xfer.start(1, list(range(8)), list(range(8)), [], [])
    xfer.wait_all()
    assert xfer.poll_done() == [1]
    xfer.release([1])
    torch.cuda._sleep(_SPIN)
    behind_spin = torch.cuda.Event()
    behind_spin.record()
    xfer.start(2, [], [], [0, 1, 2], [40, 41, 42], ordered=False)
    xfer.start(3, [], [], [5], [60], ordered=False)  # joined: the stream's next work waits
    xfer.wait_on_device(3)
    after_join = torch.cuda.Event()
    after_join.record()
    # ordered: after the spin (and the joined load); the scheduler puts early loads first, as
    # here, since a stream's copies run in order
    xfer.start(4, [], [], [3, 4], [50, 51])
    _wait_for_landing(xfer, 2)
    _wait_for_landing(xfer, 3)
    assert not behind_spin.query() and not after_join.query()
    ordered = xfer._pending[4]
    assert not (ordered.issued and ordered.end.query())
    xfer.wait_all()
    torch.cuda.synchronize()
    for p, e in zip(parts(caches), expected):
        for host_block, device_block in ((0, 40), (1, 41), (2, 42), (3, 50), (4, 51), (5, 60)):
            assert torch.equal(p[device_block], e[host_block])


def _wait_for_landing(xfer, transfer_id: int) -> None:
    """Feed the side stream for ~40 ms of the spin's ~100 until the transfer lands."""
    transfer = xfer._pending[transfer_id]
    for _ in range(40):
        xfer.pump()
        if transfer.issued and transfer.end.query():
            return
        time.sleep(0.001)
    raise AssertionError(f"transfer {transfer_id} did not land beside the spin")


def _block_bytes(values, block: int, bytes_per_block: int) -> torch.Tensor:
    """A device block's bytes as the host tier lays them out (K, V of each layer in order)."""
    stacked = torch.cat([v[block].contiguous().view(torch.uint8).reshape(-1).cpu()
                         for v in values])
    assert stacked.numel() == bytes_per_block
    return stacked
