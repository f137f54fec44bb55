"""Attention over the paged KV cache for any batch: decode, chunked prefill, prefill over a cached
prefix, and mixes of them, in one launch (plus a merge launch when the keys are split).

Each program handles one (KV head, query tile, key split). Query tiles pack the GQA group (see
common.py), so a decode token fills GROUP rows and K/V are read once per KV head. When the query
tiles alone cannot fill the GPU (decode, short chunks over long contexts), the keys are split into
`num_splits` equal chunks (flash decoding); programs then write unnormalised partials and
reduce.merge_splits combines them.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from echo_kernels.attention.common import (
    LOG2E,
    M_FLOOR,
    TileConfig,
    attend_key_range,
    batch_tile_config,
    causal_bounds,
    find_seq,
    interpreting,
    query_rows,
)
from echo_kernels.attention.reduce import merge_splits
from echo_kernels.cache import checked_cache_scales, store_cache_rows
from echo_kernels.device import sm_count
from echo_kernels.pdl import pdl_options, wait_for_inputs
from echo_kernels.rope import rotary_embedding, rotated_rows


# NOTE: ints that change from step to step are not specialised (Triton would otherwise compile
# separate variants for 1, multiples of 16 and the rest): the block table's width is one of
# them. warm_up_paged_attention compiles the rest.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "block_base", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads] float32 (IS_INT8_KV)
    v_scale_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads] float32 (IS_INT8_KV)
    block_table_ptr,  # [num_seqs, max_blocks] int32
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32, context including the run
    seq_order_ptr,  # [num_seqs] int32, sequences longest first (ORDERED)
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM] (not SPLIT)
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM] float32 (SPLIT)
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] float32: max, sum (SPLIT)
    num_seqs,
    num_heads,
    num_splits,
    qk_scale,  # softmax_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_st,
    stride_sh,
    stride_bt,
    block_base,  # K/V offsets count from this cache block (see paged_attention)
    k_new_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM] the step's keys, unrotated (FUSED_ROPE)
    v_new_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM] (FUSED_ROPE)
    positions_ptr,  # [num_tokens] (FUSED_ROPE)
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32 (FUSED_ROPE)
    q_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    k_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    slot_mapping_ptr,  # [num_tokens]; -1: not stored (FUSED_ROPE)
    stride_nkt,
    stride_nkh,
    stride_nvt,
    stride_nvh,
    stride_cos,
    rope_eps,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (tokens)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ONE_TILE_PER_SEQ: tl.constexpr,  # every run fits one tile: tile index == sequence index
    ORDERED: tl.constexpr,  # one tile per sequence, taken in seq_order's order
    SPLIT: tl.constexpr,
    IS_INT8_KV: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,  # K/V offsets from the block_base'th block may pass +-2^31
    FUSED_ROPE: tl.constexpr,  # decode: rotate q/k (after the q/k norm) and store K/V here
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,  # Qwen3's per-head RMSNorm of q and k before the rotation
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    tl.static_assert((HEAD_DIM & (HEAD_DIM - 1)) == 0, "HEAD_DIM must be a power of two")
    tl.static_assert((BLOCK_SIZE & (BLOCK_SIZE - 1)) == 0, "block size must be a power of two")
    kv_head = tl.program_id(0)
    # NOTE: later tiles of a run see more keys; launching them first shortens the tail.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    split = tl.program_id(2)

    if ORDERED:
        seq = tl.load(seq_order_ptr + tl.program_id(1))
        row0 = 0
    elif ONE_TILE_PER_SEQ:
        seq = tile
        row0 = 0
    else:
        seq = find_seq(cu_seqlens_q_ptr, num_seqs, tile, GROUP, BLOCK_M)
        first_tile = tl.load(cu_seqlens_q_ptr + seq) * GROUP // BLOCK_M + seq
        row0 = (tile - first_tile) * BLOCK_M
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if row0 >= q_len * GROUP:
        return
    ctx_len = tl.load(seq_lens_ptr + seq)

    tokens, heads, row_ok, q_pos = query_rows(row0, q_start, q_len, ctx_len, kv_head, GROUP,
                                              BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if SPLIT:
        # NOTE: split by this sequence's own context, not the grid's max_seqlen_k bound: a CUDA
        # graph captured for max_model_len then still spreads a short context over every split
        split_len = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
        kv_lo = split * split_len
        kv_hi = tl.minimum(ctx_len, kv_lo + split_len)
        if kv_lo >= kv_hi:
            # no key of this context here (a graph captured for max_model_len gives a short
            # context a few of its splits): a max and a sum that merge_splits weighs 0, whose
            # output it then does not read, and none of q's loads and rotation
            part = (tokens * num_heads + heads) * num_splits + split
            tl.store(part_ml_ptr + part * 2, tl.full([BLOCK_M], M_FLOOR, tl.float32),
                     mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, tl.zeros([BLOCK_M], tl.float32), mask=row_ok)
            return
    else:
        kv_lo = 0
        kv_hi = ctx_len
    if FUSED_ROPE:
        # decode: the rows are the heads of the run's one token, q as the model left it
        pos = tl.load(positions_ptr + q_start).to(tl.int64)
        head0 = q_start.to(tl.int64) * stride_qt + kv_head * GROUP * stride_qh
        q = _rotated_group(q_ptr, head0, stride_qh, row_ok, cos_sin_ptr, stride_cos, pos,
                           q_norm_ptr, rope_eps, GROUP, BLOCK_M, HEAD_DIM, IS_NEOX, HAS_NORM)
    else:
        q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh
        q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if IS_INT8_KV:
        # int8 K/V become exact float16 (common.int8_to_fp16), so the products run in float16.
        # NOTE: a query element past float16's 65504 would overflow; real q/k stay far below.
        q = q.to(tl.float16)

    if FUSED_ROPE:
        # decode: the token sees every key of the context, so only a partial last tile is masked
        # (an empty split returned above; the maximum tells the compiler the difference is
        # not negative, so the division is a shift: without it one more instruction, offline sm_90)
        full_hi = kv_lo + tl.maximum(kv_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
        masked_hi = kv_hi
        # the program whose keys end with the token's own stores its K/V, then reads them back
        # with the rest (the barrier makes its threads' stores visible to each other)
        if (kv_lo <= ctx_len - 1) & (ctx_len - 1 < kv_hi):
            _store_new_kv(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr,
                          v_scale_ptr, slot_mapping_ptr, q_start, kv_head, cos_sin_ptr,
                          stride_cos, pos, k_norm_ptr, rope_eps, stride_nkt, stride_nkh,
                          stride_nvt, stride_nvh, stride_kb, stride_kt, stride_kh, stride_sb,
                          stride_st, stride_sh, HEAD_DIM, BLOCK_SIZE, IS_NEOX, HAS_NORM,
                          IS_INT8_KV)
        tl.debug_barrier()
    else:
        full_hi, masked_hi = causal_bounds(row0, q_len, ctx_len, kv_lo, kv_hi, True, GROUP,
                                           BLOCK_M, BLOCK_N)

    kv_shift = block_base.to(tl.int64) * stride_kb + kv_head * stride_kh
    k_base = k_cache_ptr + kv_shift
    v_base = v_cache_ptr + kv_shift
    scale_shift = block_base.to(tl.int64) * stride_sb + kv_head * stride_sh
    ks_base = k_scale_ptr + scale_shift
    vs_base = v_scale_ptr + scale_shift
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], M_FLOOR, dtype=tl.float32)
    # Decode skips a loop with no tile: each loop is a pipeline prologue and epilogue (~1,000
    # sm_90 instructions) that a one-warp program runs even when it has no tile for it. One
    # masked loop over every tile instead was faster at 256 keys and slower at 2,048. With the
    # group's rows rotated alone (_rotated_group) the launch with its merge took 6.20 us at
    # Qwen3-0.6B's 256 keys and 11.27 at 2,048, against 8.15 and 12.85 before (one H100,
    # 2026-12-07: docs/benchmarks.md, Decode latency at batch 1).
    if (full_hi > kv_lo) | (not FUSED_ROPE):
        acc, l_i, m_i = attend_key_range(
            acc, l_i, m_i, q, q_pos, kv_lo, full_hi, kv_hi, k_base, v_base, ks_base, vs_base,
            bt_row, block_base, stride_kb, stride_kt, stride_sb, stride_st, qk_scale,
            False, True, True, IS_INT8_KV, WIDE_OFFSETS, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
        )
    if (masked_hi > full_hi) | (not FUSED_ROPE):
        acc, l_i, m_i = attend_key_range(
            acc, l_i, m_i, q, q_pos, full_hi, masked_hi, kv_hi, k_base, v_base, ks_base,
            vs_base, bt_row, block_base, stride_kb, stride_kt, stride_sb, stride_st, qk_scale,
            True, not FUSED_ROPE, True, IS_INT8_KV, WIDE_OFFSETS, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
        )

    if SPLIT:
        part = (tokens * num_heads + heads) * num_splits + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        # a padded sequence (no keys) writes zeros, not 0/0
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _rotated_group(q_ptr, head0, stride_qh, row_ok, cos_sin_ptr, stride_cos, pos, q_norm_ptr,
                   eps, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                   IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr):
    """The decode tile's q [BLOCK_M, HEAD_DIM]: the token's GROUP heads from head0 normalised
    and rotated, rows past GROUP zero. Only the group's rows (rounded up to a power of two) are
    loaded and rotated, then repeated down the tile: a one-warp program spent ~1,300 of its
    ~4,000 sm_90 instructions rotating all 16 rows where Qwen3-0.6B has 2 real ones."""
    ROWS: tl.constexpr = (1 if GROUP == 1 else 2 if GROUP == 2 else 4 if GROUP <= 4
                          else 8 if GROUP <= 8 else 16)
    g = tl.arange(0, ROWS)
    q = rotated_rows(q_ptr, head0 + g.to(tl.int64) * stride_qh, g < GROUP, cos_sin_ptr,
                     stride_cos, pos, q_norm_ptr, eps, HEAD_DIM, IS_NEOX, HAS_NORM)
    # row r of the tile is the group's row r % ROWS
    q = tl.reshape(tl.broadcast_to(q[None, :, :], (BLOCK_M // ROWS, ROWS, HEAD_DIM)),
                   (BLOCK_M, HEAD_DIM))
    return tl.where(row_ok[:, None], q, 0.0)


@triton.jit
def _store_new_kv(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                  slot_mapping_ptr, token, kv_head, cos_sin_ptr, stride_cos, pos, k_norm_ptr,
                  eps, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_kb, stride_kt,
                  stride_kh, stride_sb, stride_st, stride_sh, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
                  IS_INT8_KV: tl.constexpr):
    """One token's K (normalised and rotated) and V of one KV head into its cache slot, as
    rotary_embedding's store would write them."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        row = tl.zeros([1], dtype=tl.int64)  # a one-row tile, for the row helpers
        ok = row == 0
        k = rotated_rows(k_new_ptr, row + token * stride_nkt + kv_head * stride_nkh, ok,
                         cos_sin_ptr, stride_cos, pos, k_norm_ptr, eps, HEAD_DIM, IS_NEOX,
                         HAS_NORM)
        offs_d = tl.arange(0, HEAD_DIM)
        v = tl.load(v_new_ptr + (row + token * stride_nvt + kv_head * stride_nvh)[:, None]
                    + offs_d[None, :])
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        cache_off = (row + block * stride_kb + offset * stride_kt + kv_head * stride_kh)[:, None]
        scale_off = row + block * stride_sb + offset * stride_st + kv_head * stride_sh
        store_cache_rows(k_cache_ptr, k_scale_ptr, cache_off + offs_d[None, :], scale_off, k, ok,
                         IS_INT8_KV)
        store_cache_rows(v_cache_ptr, v_scale_ptr, cache_off + offs_d[None, :], scale_off, v, ok,
                         IS_INT8_KV)


# K/V offsets are int32. In a cache past 2^31 elements they count from its middle block, which
# reaches 2^32 elements; only larger caches take int64 offsets, which lengthen the one-warp
# decode loop (sm_90 SASS counts: docs/benchmarks.md, History 18273cb). The engine-sized int8
# cache of Qwen3-0.6B on an H200 is past 2^31 elements per layer.
_INT32_OFFSETS = 2**31


def cache_offsets(k_cache: torch.Tensor) -> tuple[int, bool]:
    """The cache block that K/V offsets count from, and whether they need int64."""
    numel, block_stride = k_cache.numel(), k_cache.stride(0)
    if numel < _INT32_OFFSETS:
        return 0, False
    middle = k_cache.shape[0] // 2
    below, above = middle * block_stride, numel - middle * block_stride  # [-below, above)
    return middle, max(below, above) > _INT32_OFFSETS


# Splits aim at two waves of programs (TileConfig.programs_per_sm per SM each), and give each
# split at least MIN_SPLIT_LEN keys so the partials' write and merge stay small next to the K/V
# reads. Two waves, not one: within one wave nothing shortens the longest context's program,
# which in a batch of mixed lengths runs long after the rest; over two, programs start longest
# first (seq_order) and the short ones fill in around the long ones. NOTE: on an H200, two
# waves longest first beat one wave in batch order on a mixed-length decode batch, int8 and
# bf16. The split count rounds down: at B=8 x 32K, 5 splits (320 programs for 264 places) once
# left a partial second wave, much slower than 4. Figures: docs/benchmarks.md (History
# 00075d0, 7939db3).
_MIN_SPLIT_LEN = 256
_MAX_SPLITS = 128
_WAVES = 2


def wave_size(config: TileConfig, device: torch.device) -> int:
    """Programs of these tiles that the GPU runs at once."""
    return config.programs_per_sm * sm_count(device, without_gpu=8)


def choose_num_splits(num_programs: int, max_seqlen_k: int, config: TileConfig,
                      wave: int) -> int:
    """Key splits so that (query tiles x KV heads x splits) fills the GPU twice with programs
    (`wave`: wave_size of these tiles).

    Host-side and sync-free: it sees only the grid size and the max_seqlen_k bound, so a CUDA
    graph captured with a max_seqlen_k stays valid for every shorter context it replays."""
    return max(1, min(_WAVES * wave // num_programs, max_num_splits(max_seqlen_k, config)))


def max_num_splits(max_seqlen_k: int, config: TileConfig) -> int:
    """The most key splits a context of max_seqlen_k keys gets."""
    min_len = config.block_n if interpreting() else _MIN_SPLIT_LEN
    return min(triton.cdiv(max_seqlen_k, min_len), _MAX_SPLITS)


@dataclass(frozen=True)
class LaunchPlan:
    """How paged_attention launches a batch: its tiles and the kernel's compile-time flags."""
    config: TileConfig
    num_tiles: int
    one_tile: bool
    ordered: bool
    num_splits: int
    fused_rope: bool = False  # the decode launch rotates q/k and stores K/V itself

    @property
    def variant(self) -> tuple:
        """What Triton compiles a separate kernel for (with the cache's dtype and offsets, and
        the rotation's flags)."""
        return self.config, self.one_tile, self.ordered, self.num_splits > 1, self.fused_rope


def plan_launch(num_tokens: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int,
                is_int8: bool, max_seqlen_q: int, max_seqlen_k: int, has_seq_order: bool,
                device: torch.device, num_splits: int | None = None,
                config: TileConfig | None = None, has_new_kv: bool = False) -> LaunchPlan:
    """paged_attention's launch for a batch (host-side, from sizes and bounds only).
    has_new_kv: the step's K/V come with the call (NewKV) instead of already in the cache."""
    if config is None:
        config = batch_tile_config(max_seqlen_q, num_tokens, num_seqs, group, head_dim, is_int8)
    one_tile = max_seqlen_q * group <= config.block_m
    num_tiles = num_seqs if one_tile else num_tokens * group // config.block_m + num_seqs
    wave = wave_size(config, device)
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, max_seqlen_k, config, wave)
    split_len = triton.cdiv(triton.cdiv(max_seqlen_k, num_splits), config.block_n) * config.block_n
    num_splits = max(1, triton.cdiv(max_seqlen_k, split_len))
    # NOTE: only past one wave: an ordered program's first load waits on seq_order, which costs
    # latency and gains nothing when every program starts at once. Past one wave, longest
    # first beat batch order on a mixed-length decode batch, int8 and bf16 (docs/benchmarks.md,
    # History 00075d0).
    ordered = (has_seq_order and one_tile and num_seqs > 1
               and num_tiles * num_kv_heads * num_splits > wave)
    # one token per sequence whose GQA group fits a tile: that tile's programs rotate it
    fused_rope = has_new_kv and one_tile and max_seqlen_q == 1
    return LaunchPlan(config, num_tiles, one_tile, ordered, num_splits, fused_rope)


@dataclass(frozen=True)
class NewKV:
    """The step's keys and values before rotary embedding and the cache write, for
    paged_attention to rotate and store them itself (rotary_embedding's arguments)."""
    k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens]; -1: not stored
    positions: torch.Tensor  # [num_tokens]
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32: cos, then sin
    q_norm_weight: torch.Tensor | None = None  # [head_dim], with k_norm_weight (Qwen3)
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    is_neox: bool = True


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    seq_order: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    config: TileConfig | None = None,
    new_kv: NewKV | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's query run over its paged context.

    q [num_tokens, num_heads, head_dim]; k_cache/v_cache [num_blocks, block_size, num_kv_heads,
    head_dim] (int8 with k_scale/v_scale [num_blocks, block_size, num_kv_heads]); block_table
    [num_seqs, max_blocks] int32; cu_seqlens_q [num_seqs + 1] int32; seq_lens [num_seqs] int32,
    each context including its run, whose K/V are already in the cache. The run of sequence s is
    its last q_len tokens; query i sees keys 0 .. seq_len - q_len + i. max_seqlen_q/max_seqlen_k
    are host ints (upper bounds are fine) used only to size the grid. seq_order [num_seqs] int32,
    the sequences by descending seq_len, is the launch order when the programs of a decode batch
    take more than one wave: the longest start first instead of prolonging the last wave.
    num_splits and config override the split count and tiles the shapes would get (tests,
    benchmarks). new_kv: q and the step's K/V as the qkv projection left them, which
    paged_attention first rotates (after Qwen3's q/k norm) and stores, as rotary_embedding
    would; when every sequence has one query token and its GQA group fits a tile (decode), in
    the attention launch itself: the program that reads the token's own key stores it.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1, "head_dim must be contiguous"
    is_int8, k_scale, v_scale = checked_cache_scales(k_cache, v_cache, k_scale, v_scale)
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    plan = plan_launch(num_tokens, num_seqs, num_kv_heads, group, head_dim, is_int8,
                       max_seqlen_q, max_seqlen_k, seq_order is not None, q.device, num_splits,
                       config, new_kv is not None)
    if new_kv is not None and not plan.fused_rope:
        rotary_embedding(new_kv.positions, q, new_kv.k, new_kv.cos_sin_cache, new_kv.is_neox,
                         new_kv.q_norm_weight, new_kv.k_norm_weight, new_kv.eps, v=new_kv.v,
                         k_cache=k_cache, v_cache=v_cache, slot_mapping=new_kv.slot_mapping,
                         k_scale=k_scale, v_scale=v_scale)
    config, num_splits = plan.config, plan.num_splits
    split = num_splits > 1
    if split:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32,
                              device=q.device)
    else:
        part_acc = part_ml = out  # unused

    block_base, wide = cache_offsets(k_cache)
    rope = new_kv if plan.fused_rope else NewKV(q, q, q, q, q)  # placeholders, never read
    has_norm = plan.fused_rope and rope.q_norm_weight is not None
    if plan.fused_rope:
        assert rope.k.stride(2) == 1 and rope.v.stride(2) == 1
        assert rope.cos_sin_cache.shape[1] == head_dim and rope.cos_sin_cache.stride(1) == 1
    grid = (num_kv_heads, plan.num_tiles, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, block_table, cu_seqlens_q, seq_lens,
        seq_order if plan.ordered else seq_lens, out, part_acc, part_ml,
        num_seqs, num_heads, num_splits, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2), block_table.stride(0),
        block_base,
        rope.k, rope.v, rope.positions, rope.cos_sin_cache,
        rope.q_norm_weight if has_norm else q, rope.k_norm_weight if has_norm else q,
        rope.slot_mapping, rope.k.stride(0), rope.k.stride(1), rope.v.stride(0),
        rope.v.stride(1), rope.cos_sin_cache.stride(0), rope.eps,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, ONE_TILE_PER_SEQ=plan.one_tile,
        ORDERED=plan.ordered,
        SPLIT=split, IS_INT8_KV=is_int8, WIDE_OFFSETS=wide,
        FUSED_ROPE=plan.fused_rope, IS_NEOX=rope.is_neox, HAS_NORM=has_norm,
        **pdl_options(q.device),
        **config.launch_options(),
    )
    if split:
        merge_splits(part_acc, part_ml, out)
    return out
