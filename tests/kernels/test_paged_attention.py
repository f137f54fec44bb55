"""paged_attention against the float32 reference, over caches whose unused slots are NaN.

CPU (interpreter) cases are tiny but walk every path: decode with and without key splits (and
the merge), multi-tile prefill runs, prefill over a cached prefix, mixed batches, GQA groups of
1/2/3/4, block sizes 16/32/64, int8 caches. GPU cases use the real head shapes in bf16.
"""

import random

import numpy as np
import pytest
import torch
from kernel_utils import PagedBatch, assert_close

from echo.worker.step_buffers import longest_first
from echo_kernels import paged_attention
from echo_kernels.attention import paged
from echo_kernels.reference import paged_attention_ref

# (num_heads, num_kv_heads): groups 2, 4, 1 and a non-power-of-two 3
CPU_HEADS = [(4, 2), (4, 1), (2, 2), (6, 2)]
CPU_ATOL = {torch.float16: 3e-3, torch.float32: 1e-4}


@pytest.mark.parametrize("heads", CPU_HEADS)
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_decode(paged_batch, heads, block_size):
    # contexts of 1 and around block-size multiples; the split heuristic splits these on CPU
    ctx = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 1]
    b = paged_batch([1] * len(ctx), ctx, *heads, 32, block_size, torch.float16)
    assert_close(b.run(), b.reference(), CPU_ATOL[torch.float16])


@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_decode_forced_splits(paged_batch, num_splits):
    # 5 splits of 32 keys over contexts <= 97: some splits see no key at all
    b = paged_batch([1, 1, 1], [97, 3, 40], 4, 2, 32, 16, torch.float32)
    assert_close(b.run(num_splits=num_splits), b.reference(), CPU_ATOL[torch.float32])


@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_with_a_late_dominant_key(paged_batch, num_splits):
    # a key scoring far above every earlier one arrives in a late tile: decode tiles rescale the
    # output only when a row's max grows past a threshold, which it does here
    b = paged_batch([1, 1], [200, 70], 4, 2, 32, 16, torch.float16)
    for seq, pos in ((0, 190), (1, 40)):
        block = b.block_table[seq, pos // 16].item()
        b.k_cache[block, pos % 16, 0] = b.q[seq, 0] * 8  # query head 0 reads KV head 0
    assert_close(b.run(num_splits=num_splits), b.reference(), CPU_ATOL[torch.float16])


def test_decode_splits_follow_each_context_not_the_bound(paged_batch):
    # a CUDA graph launches with max_seqlen_k = max_model_len; each sequence spreads its own
    # context over the splits (a context of 3 over 8 splits leaves 7 empty)
    b = paged_batch([1, 1, 1], [97, 3, 40], 4, 2, 32, 16, torch.float32)
    b.max_seqlen_k = 4096
    assert_close(b.run(num_splits=8), b.reference(), CPU_ATOL[torch.float32])


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
def test_decode_in_seq_order(paged_batch, kv_dtype):
    # 12 sequences x 2 KV heads = 24 programs, more than the interpreter's wave of 16: programs
    # take their sequence from seq_order (the engine passes the longest first)
    ctx = [5, 70, 33, 1, 64, 17, 90, 2, 48, 31, 16, 65]
    b = paged_batch([1] * len(ctx), ctx, 4, 2, 32, 16, torch.float16, kv_dtype=kv_dtype)
    order = torch.tensor(sorted(range(len(ctx)), key=lambda s: -ctx[s]), dtype=torch.int32)
    assert_close(b.run(seq_order=order), b.reference(), CPU_ATOL[torch.float16])
    # every program pointed at sequence 0: the other sequences' rows stay unwritten (NaN)
    out = b.run(seq_order=torch.zeros_like(order))
    assert out[1:].isnan().all() and not out[0].isnan().any()


def test_cache_offsets_count_from_the_middle_block(monkeypatch):
    from echo_kernels.attention import paged

    cache = torch.empty(10, 16, 2, 32, dtype=torch.int8)  # 1024 elements a block
    monkeypatch.setattr(paged, "_INT32_OFFSETS", 8192)  # stands for 2^31
    assert paged.cache_offsets(cache[:7]) == (0, False)
    assert paged.cache_offsets(cache) == (5, False)  # offsets within [-5120, 5120)
    monkeypatch.setattr(paged, "_INT32_OFFSETS", 4096)
    assert paged.cache_offsets(cache) == (5, True)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("wide", [False, True])
def test_cache_past_the_int32_offset_limit(paged_batch, monkeypatch, kv_dtype, wide):
    from echo_kernels.attention import paged

    # decodes and a short prefill run over a cache larger than a lowered offset limit: offsets
    # count from the middle block (negative below it) or, past twice the limit, go int64
    b = paged_batch([1, 1, 4], [40, 97, 30], 4, 2, 32, 16, torch.float16, kv_dtype=kv_dtype)
    numel = b.k_cache.numel()
    monkeypatch.setattr(paged, "_INT32_OFFSETS", numel // 4 if wide else numel - 1)
    assert paged.cache_offsets(b.k_cache) == (b.k_cache.shape[0] // 2, wide)
    assert_close(b.run(), b.reference(), CPU_ATOL[torch.float16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(4, 2), (6, 2), (2, 2)])
def test_mixed_batch(paged_batch, dtype, heads):
    # decode, a fresh prefill, a chunk over a cached prefix, decode at a block boundary
    q_lens, ctx = [1, 13, 9, 1, 1], [40, 13, 50, 32, 1]
    b = paged_batch(q_lens, ctx, *heads, 32, 16, dtype)
    assert_close(b.run(), b.reference(), CPU_ATOL[dtype])


def test_mixed_batch_split(paged_batch):
    # key splits under prefill rows: causal rows that see nothing in a split must drop out
    b = paged_batch([1, 13, 9], [70, 13, 75], 4, 2, 32, 32, torch.float32)
    assert_close(b.run(num_splits=3), b.reference(), CPU_ATOL[torch.float32])


@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_multi_tile(paged_batch, block_size):
    # runs of several 32-row tiles (binary search over tiles), a fresh one and one over a prefix
    b = paged_batch([20, 17], [20, 60], 4, 2, 32, block_size, torch.float16)
    assert_close(b.run(), b.reference(), CPU_ATOL[torch.float16])


@pytest.mark.parametrize("q_lens,ctx", [([1, 1, 1], [33, 1, 64]), ([1, 9, 12], [30, 9, 47])])
def test_int8_cache(paged_batch, q_lens, ctx):
    b = paged_batch(q_lens, ctx, 4, 2, 32, 16, torch.float16, kv_dtype=torch.int8)
    assert b.k_cache.dtype == torch.int8
    assert_close(b.run(), b.reference(), CPU_ATOL[torch.float16])


def test_strided_q_and_default_out(device):
    b = PagedBatch([1, 5], [20, 5], 4, 2, 32, 16, 8, torch.float16, device)
    # q as a view into a fused qkv projection output
    qkv = torch.randn(6, (4 + 2 * 2) * 32, dtype=torch.float16, device=device)
    q = qkv[:, : 4 * 32].view(6, 4, 32)
    out = paged_attention(q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q, b.seq_lens,
                          5, 20, 0.125)
    ref = paged_attention_ref(q, b.k_cache, b.v_cache, b.block_table, b.cu_seqlens_q,
                              b.seq_lens, 0.125)
    assert out.shape == q.shape and out.is_contiguous()
    assert_close(out, ref, CPU_ATOL[torch.float16])


def _with_new_kv(b: PagedBatch, is_neox: bool, norm: bool, padded_seq: int | None = None,
                 **kwargs):
    """The batch's step tokens (each run's last tokens) attended twice: rotary_embedding storing
    K/V and then paged_attention (the separate launches), and paged_attention given the K/V
    (NewKV). Returns (separate, given) as (out, k_cache, v_cache, k_scale, v_scale) each."""
    from echo_kernels import rotary_embedding
    from echo_kernels.attention.paged import NewKV

    device, dtype = b.q.device, b.q.dtype
    num_tokens, num_heads, head_dim = b.q.shape
    num_kv_heads = b.k_cache.shape[2]
    gen = torch.Generator(device="cpu").manual_seed(3)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    # each run's tokens are its context's last ones, in its blocks
    positions, slots = [], []
    for s, (q_len, ctx) in enumerate(zip(b.q_lens, b.ctx_lens, strict=True)):
        for pos in range(ctx - q_len, ctx):
            positions.append(pos)
            slot = b.block_table[s, pos // b.k_cache.shape[1]].item() * b.k_cache.shape[1]
            slots.append(-1 if s == padded_seq else slot + pos % b.k_cache.shape[1])
    positions = torch.tensor(positions, device=device)
    slots = torch.tensor(slots, device=device)
    cos_sin = torch.randn(max(b.ctx_lens), head_dim, generator=gen).to(device)
    q_w, k_w = ((torch.rand(head_dim, generator=gen) + 0.5).to(dtype).to(device) if norm
                else None for _ in range(2))
    caches = (b.k_cache, b.v_cache, b.k_scale, b.v_scale)

    def attend(new_kv: bool):
        kc, vc, ks, vs = (None if c is None else c.clone() for c in caches)
        q, k_in = b.q.clone(), k.clone()
        if not new_kv:
            rotary_embedding(positions, q, k_in, cos_sin, is_neox, q_w, k_w, 1e-6, v=v,
                             k_cache=kc, v_cache=vc, slot_mapping=slots, k_scale=ks, v_scale=vs)
        given = NewKV(k_in, v, slots, positions, cos_sin, q_w, k_w, 1e-6, is_neox)
        out = paged_attention(q, kc, vc, b.block_table, b.cu_seqlens_q, b.seq_lens,
                              b.max_seqlen_q, b.max_seqlen_k, b.scale, ks, vs,
                              new_kv=given if new_kv else None, **kwargs)
        return out, kc, vc, ks, vs

    return attend(False), attend(True)


def _assert_caches_match(got, want, atol: float) -> None:
    """(k_cache, v_cache, k_scale, v_scale) written alike. The q/k norm sums its squares in
    another order in the attention launch, which may move a rotated key by an ulp, and so an
    int8 value by one step."""
    for got_cache, want_cache in zip(got[:2], want[:2], strict=True):
        if got_cache.dtype == torch.int8:
            assert (got_cache.int() - want_cache.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(got_cache, want_cache, atol=atol, rtol=0, equal_nan=True)
    for got_scale, want_scale in zip(got[2:], want[2:], strict=True):
        if got_scale is not None:
            torch.testing.assert_close(got_scale, want_scale, rtol=2e-3, atol=0, equal_nan=True)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
# groups of 3 and 4, and of 1 and 2: the launch rotates a group's heads rounded up to a power of
# two and repeats them down the query tile
@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("is_neox,norm", [(True, True), (False, False)])
def test_decode_given_new_kv(paged_batch, kv_dtype, heads, num_splits, is_neox, norm):
    # the attention launch rotates q and the new keys itself and stores K/V: the split whose
    # keys end with the token's own stores it; one sequence's token is padding (slot -1)
    b = paged_batch([1, 1, 1, 1], [97, 3, 40, 1], *heads, 32, 16, torch.float32,
                    kv_dtype=kv_dtype)
    plan = paged.plan_launch(4, 4, heads[1], heads[0] // heads[1], 32, kv_dtype == torch.int8,
                             1, 97, False, b.q.device, num_splits, has_new_kv=True)
    assert plan.fused_rope
    separate, given = _with_new_kv(b, is_neox, norm, padded_seq=2, num_splits=num_splits)
    assert_close(given[0], separate[0], 1e-5)
    _assert_caches_match(given[1:], separate[1:], 1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
def test_mixed_batch_given_new_kv(paged_batch, kv_dtype):
    # runs of several tokens: rotated and stored by rotary_embedding first, then attended
    b = paged_batch([1, 5, 2], [20, 5, 33], 4, 2, 32, 16, torch.float16, kv_dtype=kv_dtype)
    separate, given = _with_new_kv(b, True, True)
    assert_close(given[0], separate[0], 0)  # the same launches
    _assert_caches_match(given[1:], separate[1:], 0)


# ---------------------------------------------------------------------------------------- GPU

GPU_HEADS = [(32, 8), (40, 40), (64, 8), (16, 1)]
GPU_ATOL = 2e-2
POOL = 4096  # blocks in the cache pool


def _random_ctx(rng: random.Random, block_size: int, n: int, max_len: int) -> list[int]:
    """Context lengths: 1, block multiples and +-1 around them, and uniform ones."""
    special = [1, block_size, block_size - 1, block_size + 1, 4 * block_size,
               4 * block_size + 1, 4 * block_size - 1]
    return [rng.choice(special) if rng.random() < 0.4 else rng.randint(1, max_len)
            for _ in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_gpu_decode(paged_batch, heads, head_dim, block_size):
    rng = random.Random(f"decode{heads}{head_dim}{block_size}")
    ctx = _random_ctx(rng, block_size, 24, 2000)
    b = paged_batch([1] * len(ctx), ctx, *heads, head_dim, block_size, torch.bfloat16,
                    num_blocks=POOL, seed=rng.randint(0, 1000))
    assert_close(b.run(), b.reference(), GPU_ATOL)
    # past one wave of programs (unsplit), longest first
    ctx = _random_ctx(rng, block_size, 160, 1000)
    b = paged_batch([1] * len(ctx), ctx, *heads, head_dim, block_size, torch.bfloat16,
                    seed=rng.randint(0, 1000))
    order = torch.tensor(longest_first(np.array(ctx)), device="cuda")
    assert_close(b.run(seq_order=order), b.reference(), GPU_ATOL)
    # a batch of one long context goes through many splits and the merge
    b = paged_batch([1], [8191], *heads, head_dim, block_size, torch.bfloat16,
                    num_blocks=max(POOL, 8191 // block_size + 16))
    assert_close(b.run(), b.reference(), GPU_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
def test_gpu_mixed(paged_batch, heads, head_dim, block_size):
    rng = random.Random(f"mixed{heads}{head_dim}{block_size}")
    ctx = _random_ctx(rng, block_size, 16, 1500)
    # decodes, fresh prefills, chunks over cached prefixes
    q_lens = [rng.choice([1, 1, c, rng.randint(1, c)]) for c in ctx]
    b = paged_batch(q_lens, ctx, *heads, head_dim, block_size, torch.bfloat16, num_blocks=POOL,
                    seed=rng.randint(0, 1000))
    assert_close(b.run(), b.reference(), GPU_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,ctx", [(4096, 4096), (512, 8192), (3000, 3001)])
def test_gpu_long_prefill(paged_batch, q_len, ctx):
    b = paged_batch([q_len], [ctx], 32, 8, 128, 16, torch.bfloat16,
                    num_blocks=max(POOL, ctx // 16 + 16))
    assert_close(b.run(), b.reference(), GPU_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (40, 40)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_int8(paged_batch, heads, block_size):
    rng = random.Random(f"int8{heads}{block_size}")
    ctx = _random_ctx(rng, block_size, 16, 2000)
    q_lens = [rng.choice([1, 1, 1, rng.randint(1, c)]) for c in ctx]
    b = paged_batch(q_lens, ctx, *heads, 128, block_size, torch.bfloat16,
                    kv_dtype=torch.int8, num_blocks=POOL, seed=rng.randint(0, 1000))
    assert_close(b.run(), b.reference(), GPU_ATOL)
    ctx = _random_ctx(rng, block_size, 160, 1000)  # past one wave of programs, longest first
    b = paged_batch([1] * len(ctx), ctx, *heads, 128, block_size, torch.bfloat16,
                    kv_dtype=torch.int8, seed=rng.randint(0, 1000))
    order = torch.tensor(longest_first(np.array(ctx)), device="cuda")
    assert_close(b.run(seq_order=order), b.reference(), GPU_ATOL)
    b = paged_batch([1] * 8, [1, 17, 4000, 1000, 33, 64, 65, 2048], *heads, 128, block_size,
                    torch.bfloat16, kv_dtype=torch.int8, num_blocks=POOL)
    assert_close(b.run(), b.reference(), GPU_ATOL)


def test_splits_fill_the_programs_an_sm_holds():
    from echo_kernels.attention.common import TileConfig
    from echo_kernels.attention.paged import choose_num_splits, wave_size

    cpu = torch.device("cpu")  # stands for 8 SMs
    # (tiles, their wave): 2 and 3 programs per SM
    two, three = ((cfg, wave_size(cfg, cpu)) for cfg in (
        TileConfig(16, 32, 4, 3), TileConfig(16, 32, 4, 2, programs_per_sm=3)))
    # two waves: 3 programs and 2 x 16 places on 8 SMs give 10 splits (rounded down), 2 x 24
    # places give 16
    assert choose_num_splits(3, 10_000, *two) == 10
    assert choose_num_splits(3, 10_000, *three) == 16
    assert choose_num_splits(3, 100, *three) == 4  # at least 32 keys (block_n) a split
    assert choose_num_splits(16, 10_000, *two) == 2
    assert choose_num_splits(32, 10_000, *two) == 1  # the grid fills two waves already
    assert choose_num_splits(40, 10_000, *three) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads", [(32, 8), (16, 1)])
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_decode_given_new_kv(paged_batch, kv_dtype, heads, norm):
    rng = random.Random(f"new_kv{kv_dtype}{heads}{norm}")
    ctx = _random_ctx(rng, 16, 24, 2000)
    b = paged_batch([1] * len(ctx), ctx, *heads, 128, 16, torch.bfloat16, kv_dtype=kv_dtype,
                    num_blocks=POOL)
    separate, given = _with_new_kv(b, True, norm, padded_seq=3)
    assert_close(given[0], separate[0], GPU_ATOL)
    _assert_caches_match(given[1:], separate[1:], 3.2e-2)  # an ulp of bf16 near 4
