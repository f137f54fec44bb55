"""@triton.jit pieces shared by the attention kernels, plus their launch-config tables.

Query tiles pack the GQA group: a sequence's query rows are flattened as
`row = token_in_run * GROUP + head_in_group`, and a tile is BLOCK_M consecutive rows. All query
heads of one KV head then share each K/V tile (read once per KV head), a decode token fills GROUP
rows of a tile instead of one, and non-power-of-two groups (40/8 heads) waste no rows.
Sequence `s` owns tiles `cu_seqlens_q[s] * GROUP // BLOCK_M + s ...` (at least as many as it
needs, never overlapping the next sequence's), so a grid of
`num_tokens * GROUP // BLOCK_M + num_seqs` tiles covers any batch without a host sync.
"""

import os
from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
RESCALE_THRESHOLD = tl.constexpr(8.0)  # log2 units: p stays <= 256, exact enough in float16
# NOTE: the running max starts at a finite floor, not -inf: a row that sees no key in a tile
# (causal rows before a split's first key) keeps exp2(m - m_new) = 1 and p = exp2(-inf) = 0, where
# -inf - -inf would give NaN.
M_FLOOR = tl.constexpr(-1.0e30)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_FAST_INT8_TO_FP16 = tl.constexpr(not interpreting())  # the interpreter runs no inline asm


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows (tokens x GQA heads) per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int
    maxnreg: int | None = None  # registers per thread at most, so more programs fit on an SM
    programs_per_sm: int = 2  # programs an SM holds at once: key splits aim to fill them

    def launch_options(self) -> dict:
        """The kernel launch keywords these tiles set."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options


# query rows per sequence at most for the decode tiles, and for the short-run tiles
_DECODE_ROWS = 16
_SHORT_RUN_ROWS = 256


def tile_config(rows_per_seq: int, head_dim: int, is_int8: bool = False) -> TileConfig:
    """Tile sizes for query runs of about `rows_per_seq` rows (GQA heads included).

    Sizes are fixed per shape class rather than autotuned, so the first call of a shape neither
    benchmarks nor syncs (CUDA-graph capture safe).
    """
    if interpreting():
        return TileConfig(16 if rows_per_seq <= _DECODE_ROWS else 32, 32, 1, 1)
    # NOTE: picked from sweeps on an H200 at d=128, 32/8 heads, block size 16 (bench_kernels.py
    # --sweep); d=64 keeps the same bytes per K/V tile, unmeasured.
    if rows_per_seq <= _DECODE_ROWS:
        # decode: one warp per program. A 16-row query tile is one MMA row block, so one warp
        # keeps the scores, softmax and P in registers (no shared-memory exchange or barrier
        # between warps each tile); many small programs per SM hide the latency. One-warp tiles
        # beat the earlier 4-warp ones in every uniform-context case swept, bf16 and int8. int8
        # with V read as pairs (attend_key_range) fits 3 stages at 193 registers, and 3 stages
        # beat 2 in every case measured. programs_per_sm is the split target, not the fit: int8
        # fits 10 per SM, but a target of 10 was slower where it changed the splits. bf16 fits
        # 4 per SM by shared memory; with 3 stages it was as fast at full grids but fits 6, and
        # B=64 x 4K (512 programs) then ran unsplit and slower. Figures: docs/benchmarks.md
        # (Kernels, int8 KV cache, What was tried and dropped; History 00075d0, 2613bfa).
        if is_int8:
            return TileConfig(16, 32, 1, 3, programs_per_sm=8)
        return TileConfig(16, 32 if head_dim > 64 else 64, 1, 4, programs_per_sm=4)
    if rows_per_seq <= _SHORT_RUN_ROWS:
        # short runs, or decode-heavy mixes where 128-row tiles would mostly hold padding
        return TileConfig(64, 64, 4, 3)
    # long runs (wgmma, 3 stages): causal S=4096 prefill meets its TFLOP/s target contiguous
    # and paged (docs/benchmarks.md, Kernels)
    return TileConfig(128, 64 if head_dim > 64 else 128, 8, 3)


def tile_classes(head_dim: int, is_int8: bool = False
                 ) -> list[tuple[int, int | None, TileConfig]]:
    """Every tile configuration tile_config gives, with the fewest and the most rows per
    sequence that get it (None: no limit), for kernel warm-ups to compile each once."""
    classes: dict[TileConfig, list] = {}
    for first, last in ((1, _DECODE_ROWS), (_DECODE_ROWS + 1, _SHORT_RUN_ROWS),
                        (_SHORT_RUN_ROWS + 1, None)):
        config = tile_config(first, head_dim, is_int8)
        if config in classes:  # the interpreter's tiles merge classes
            classes[config][1] = last
        else:
            classes[config] = [first, last]
    return [(first, last, config) for config, (first, last) in classes.items()]


def batch_tile_config(max_seqlen_q: int, num_tokens: int, num_seqs: int, group: int,
                      head_dim: int, is_int8: bool = False) -> TileConfig:
    """tile_config for a batch: its query runs are about the mean run length (at most the
    longest), each token bringing its GQA group's rows."""
    rows_per_seq = min(max_seqlen_q, triton.cdiv(num_tokens, num_seqs)) * group
    return tile_config(rows_per_seq, head_dim, is_int8)


@triton.jit
def find_seq(
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    num_seqs,
    tile,  # this program's tile index in [0, num_tokens * GROUP // BLOCK_M + num_seqs)
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The sequence whose tile range holds `tile` (binary search over tile starts)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_seqlens_q_ptr + mid) * GROUP // BLOCK_M + mid
        go_right = start <= tile
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


@triton.jit
def query_rows(
    row0,  # first flattened row of the tile within its sequence's run
    q_start,  # first token of the run in q
    q_len,
    ctx_len,  # keys of the sequence (the run's tokens are its last q_len)
    kv_head,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Per-row token index, head index, validity and causal limit (last key each row sees)."""
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len * GROUP
    t = rows // GROUP
    tokens = (q_start + t).to(tl.int64)
    heads = kv_head * GROUP + rows % GROUP
    q_pos = ctx_len - q_len + t
    return tokens, heads, row_ok, q_pos


@triton.jit
def causal_bounds(
    row0,
    q_len,
    ctx_len,
    kv_lo,  # first key of this program's range (multiple of BLOCK_N)
    kv_hi,  # end of the range (exclusive)
    CAUSAL: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Split [kv_lo, kv_hi) into whole tiles every row sees unmasked, then the masked rest."""
    if CAUSAL:
        last_row = tl.minimum(row0 + BLOCK_M, q_len * GROUP) - 1
        first_pos = ctx_len - q_len + row0 // GROUP
        last_pos = ctx_len - q_len + last_row // GROUP
        full_hi = tl.minimum(kv_hi, first_pos + 1)
        masked_hi = tl.minimum(kv_hi, last_pos + 1)
    else:
        full_hi = kv_hi
        masked_hi = kv_hi
    full_hi = kv_lo + tl.maximum(full_hi - kv_lo, 0) // BLOCK_N * BLOCK_N
    return full_hi, masked_hi


@triton.jit
def online_softmax_step(
    l_i,  # [BLOCK_M] float32, running sum of exp2
    m_i,  # [BLOCK_M] float32, running max (log2 units)
    qk,  # [BLOCK_M, BLOCK_N] float32 scores in log2 units, -inf where masked
):
    """The tile's probabilities p, the factor alpha that rescales the output so far, and the
    updated running sum and max."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.math.exp2(qk - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


def _bytes_to_halves_asm(select_0: str, select_1: str) -> tl.constexpr:
    """PTX for int8_to_fp16's bit trick on one 32-bit register of four int8: flip each byte's
    sign bit (x + 128), place two bytes (picked by each prmt selector) under the exponent byte
    0x64 to form halves 1024 + (x + 128), and subtract 1152 in packed f16x2."""
    return tl.constexpr(f"""{{
            .reg .b32 w, bias;
            xor.b32 w, $2, 0x80808080;
            prmt.b32 $0, w, 0x64646464, {select_0};
            prmt.b32 $1, w, 0x64646464, {select_1};
            mov.b32 bias, 0x64806480;
            sub.f16x2 $0, $0, bias;
            sub.f16x2 $1, $1, bias;
            }}""")


# bytes 0, 1 and 2, 3 (four consecutive elements); bytes 0, 2 and 1, 3 (two int16 pairs)
_INT8_QUAD_ASM = _bytes_to_halves_asm("0x4140", "0x4342")
_INT8_PAIRS_ASM = _bytes_to_halves_asm("0x4240", "0x4341")


@triton.jit
def int8_to_fp16(x):
    """int8 tile as exact float16 values (the dot dtype of int8 caches).

    Without I2F instructions (16 per clock per SM on Hopper), by the bit trick of
    _bytes_to_halves_asm. Exact for every int8. On an H200 it made int8 decode faster with
    the default tiles and with the best swept (docs/benchmarks.md, History 7939db3)."""
    if _FAST_INT8_TO_FP16:
        # four int8 in one 32-bit register become two registers of two halves
        return tl.inline_asm_elementwise(_INT8_QUAD_ASM, "=r,=r,r", [x], dtype=tl.float16,
                                         is_pure=True, pack=4)
    return x.to(tl.float16)


@triton.jit
def int8_pairs_to_fp16(x):
    """int16 tile of int8 pairs (low byte: even head-dim column, high byte: odd) as two exact
    float16 tiles, the even and the odd columns, by int8_to_fp16's bit trick.

    int8 V enters the P·V product as its B operand, reduced over keys; the MMA wants each
    register to hold two keys of one column, which sit a token row apart in the cache. As int8,
    Triton 3.6 gathers them with one shared-memory byte load per element; as 16-bit pairs it
    uses transposing matrix loads, and one byte permute per two values splits each pair."""
    if _FAST_INT8_TO_FP16:
        # one 32-bit register: two int16 of consecutive keys -> (even, even), (odd, odd) halves
        return tl.inline_asm_elementwise(_INT8_PAIRS_ASM, "=r,=r,r", [x],
                                         dtype=(tl.float16, tl.float16), is_pure=True, pack=2)
    return ((x << 8) >> 8).to(tl.float16), (x >> 8).to(tl.float16)


@triton.jit
def to_dot_dtype(x, dot_dtype: tl.constexpr, IS_INT8_KV: tl.constexpr):
    if IS_INT8_KV:
        return int8_to_fp16(x)
    return x.to(dot_dtype)


@triton.jit
def exact_dot(a, b, acc):
    """tl.dot(a, b, acc), float32 operands to float32's precision: Triton's default for them is
    TF32 (a 10-bit mantissa), which a float32 model does not expect (transformers' float32
    matmuls are exact: torch leaves TF32 off). "tf32x3" (three TF32 products on the tensor
    cores, errors near float32's) rather than "ieee", whose CUDA-core dot spilled 10.8 KB a
    thread at the 128 x 64 prefill tile (sm_90, offline compile; tf32x3 656 B, TF32 280 B).
    Other dtypes as tl.dot's default."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    return tl.dot(a, b, acc)


@triton.jit
def _scores(q, k, k_sc, pos, in_range, q_pos, qk_scale, MASKED: tl.constexpr,
            CAUSAL: tl.constexpr, IS_INT8_KV: tl.constexpr):
    """One tile's scores in log2 units, -inf where a key is past the range or in the future."""
    qk = exact_dot(q, tl.trans(to_dot_dtype(k, q.dtype, IS_INT8_KV)), None)
    if IS_INT8_KV:
        qk = qk * (k_sc * qk_scale)[None, :]
    else:
        qk = qk * qk_scale
    if MASKED:
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        qk = tl.where(visible, qk, float("-inf"))
    return qk


@triton.jit
def attend_key_range(
    acc,  # [BLOCK_M, HEAD_DIM] float32
    l_i,  # [BLOCK_M] float32
    m_i,  # [BLOCK_M] float32
    q,  # [BLOCK_M, HEAD_DIM] query tile
    q_pos,  # [BLOCK_M] int32, last key index each row may see
    lo,  # first key (multiple of BLOCK_N)
    hi,  # end of the keys to visit
    kv_limit,  # keys >= kv_limit are masked (MASKED)
    k_ptr,  # K at this KV head: paged [blocks, BLOCK_SIZE, ., HEAD_DIM] or rows [., ., HEAD_DIM]
    v_ptr,  # V, same layout and strides as K
    k_scale_ptr,  # [num_blocks, BLOCK_SIZE, .] float32 at this KV head (IS_INT8_KV)
    v_scale_ptr,
    block_table_ptr,  # [max_blocks] int32 row of this sequence (PAGED)
    block_base,  # block ids count from this block, where the K/V/scale pointers point (PAGED)
    stride_kb,  # K/V stride between cache blocks (PAGED)
    stride_kt,  # K/V stride between tokens
    stride_sb,  # scale stride between cache blocks
    stride_st,  # scale stride between tokens
    qk_scale,  # softmax_scale * log2(e)
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    PAGED: tl.constexpr,
    IS_INT8_KV: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,  # K/V element offsets may pass +-2^31: compute them in int64
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Online softmax over keys [lo, hi), one BLOCK_N tile at a time (the flash inner loop)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    # int8 V in decode tiles is read as int16 pairs of head-dim neighbours (int8_pairs_to_fp16)
    # and the output kept as its even and odd columns. NOTE: larger query tiles, whose warps
    # share each V tile, convert it to float16 before shared memory instead; pairs would add
    # instructions there (sm_90 SASS, 64-row tiles: 784 -> 831 per loop step).
    V_PAIRS: tl.constexpr = IS_INT8_KV and acc.shape[0] <= 16
    # Decode tiles (one warp) skip most output rescales: past the first few tiles the running
    # max rarely grows by a factor of 2^8, and the rescale is a multiply per output element.
    LAZY_RESCALE: tl.constexpr = acc.shape[0] <= 16
    if V_PAIRS:
        v_pairs_ptr = v_ptr.to(tl.pointer_type(tl.int16))
        offs_pair = tl.arange(0, HEAD_DIM // 2)
        acc_even, acc_odd = tl.split(tl.reshape(acc, [acc.shape[0], HEAD_DIM // 2, 2]))
    if PAGED:
        # Tiles start at multiples of BLOCK_N, so a row's cache block (relative to the tile's
        # first) and its offset in that block are loop invariants; only block ids change.
        if BLOCK_N >= BLOCK_SIZE:
            blk_of_row = offs_n // BLOCK_SIZE
            row_in_blk = offs_n % BLOCK_SIZE
        else:
            blk_of_row = offs_n * 0
            row_in_blk = offs_n
        # NOTE: block ids are fetched one tile ahead into registers. Loaded in the same step as
        # the K/V they address, they make Triton's pipeliner keep K/V only double-buffered and
        # wait for every copy each step (no overlap); prefetched, K/V get a full pipeline.
        next_blk = tl.load(block_table_ptr + lo // BLOCK_SIZE + blk_of_row,
                           mask=lo + offs_n < kv_limit, other=0)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        in_range = pos < kv_limit
        if PAGED:
            blk = next_blk - block_base
            if WIDE_OFFSETS:
                blk = blk.to(tl.int64)
            ahead = start + BLOCK_N
            next_blk = tl.load(block_table_ptr + ahead // BLOCK_SIZE + blk_of_row,
                               mask=ahead + offs_n < kv_limit, other=0)
            if BLOCK_N >= BLOCK_SIZE:
                row = row_in_blk
            else:
                row = start % BLOCK_SIZE + row_in_blk
            kv_off = blk * stride_kb + row * stride_kt
            sc_off = blk * stride_sb + row * stride_st
        else:
            kv_off = (pos.to(tl.int64) if WIDE_OFFSETS else pos) * stride_kt
            sc_off = pos
        kv_ptrs = kv_off[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptr + kv_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptr + kv_ptrs)
        if IS_INT8_KV:
            if MASKED:
                k_sc = tl.load(k_scale_ptr + sc_off, mask=in_range, other=0.0)
                v_sc = tl.load(v_scale_ptr + sc_off, mask=in_range, other=0.0)
            else:
                k_sc = tl.load(k_scale_ptr + sc_off)
                v_sc = tl.load(v_scale_ptr + sc_off)
        else:
            k_sc = None
            v_sc = None
        qk = _scores(q, k, k_sc, pos, in_range, q_pos, qk_scale, MASKED, CAUSAL, IS_INT8_KV)
        if V_PAIRS:
            pair_ptrs = v_pairs_ptr + ((kv_off // 2)[:, None] + offs_pair[None, :])
            if MASKED:
                v_pairs = tl.load(pair_ptrs, mask=in_range[:, None], other=0)
            else:
                v_pairs = tl.load(pair_ptrs)
            v_even, v_odd = int8_pairs_to_fp16(v_pairs)
        else:
            if MASKED:
                v = tl.load(v_ptr + kv_ptrs, mask=in_range[:, None], other=0.0)
            else:
                v = tl.load(v_ptr + kv_ptrs)
            v = to_dot_dtype(v, q.dtype, IS_INT8_KV)
        if LAZY_RESCALE:
            # the output is rescaled only when some row's max grows by more than
            # RESCALE_THRESHOLD; otherwise p is taken against the stale max (p <= 2^threshold)
            m_tile = tl.max(qk, 1)
            if tl.max(m_tile - m_i, 0) > RESCALE_THRESHOLD:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                m_i = m_new
                if V_PAIRS:
                    acc_even = acc_even * alpha[:, None]
                    acc_odd = acc_odd * alpha[:, None]
                else:
                    acc = acc * alpha[:, None]
            p = tl.math.exp2(qk - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
        else:
            p, alpha, l_i, m_i = online_softmax_step(l_i, m_i, qk)
            acc = acc * alpha[:, None]
        if IS_INT8_KV:
            p = p * v_sc[None, :]
        if V_PAIRS:
            p = p.to(tl.float16)
            acc_even = tl.dot(p, v_even, acc_even)
            acc_odd = tl.dot(p, v_odd, acc_odd)
        else:
            acc = exact_dot(p.to(v.dtype), v, acc)
    if V_PAIRS:
        acc = tl.reshape(tl.join(acc_even, acc_odd), [acc.shape[0], HEAD_DIM])
    return acc, l_i, m_i
