"""AWQ W4A16 linear layers: y[M, N] = x[M, K] @ W[K, N], W dequantized from 4-bit on chip.

AutoAWQ's "gemm" checkpoints hold, per linear layer of in_features K, out_features N and group
size G (K when the checkpoint says -1):

    qweight int32 [K, N // 8]       eight 4-bit values per int32 along the output dim
    qzeros  int32 [K // G, N // 8]  packed the same way
    scales  fp16  [K // G, N]

    W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]

The eight values of int32 j are interleaved: AutoAWQ's packer puts output column
8j + AWQ_PACK_ORDER[i] at bits 4i..4i+3, AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]. Unpacking
inverts that: column 8j + r sits at nibble AWQ_REVERSE_ORDER[r], AWQ_REVERSE_ORDER =
[0, 4, 1, 5, 2, 6, 3, 7], i.e. at bit 4 * (r // 2) + 16 * (r % 2) (nibble_shift). An int32
whose top nibble is 8 or more is negative; every shift is masked with 0xF, so the sign does
not matter.

awq_gemv (1..GEMV_MAX_ROWS rows, two a program; awq_linear's up to LINEAR_GEMV_ROWS) works on
the CUDA cores without dequantizing: each weight becomes the float 1 + q * u by one shift and
one bitwise op into the mantissa of 1.0 (_unpack_offsets), the loop sums x * (1 + q u) and x,
and the zero and scale enter once a group (_awq_gemv_kernel's comment has the algebra): about
2.5 instructions a weight, against 6-7 for a float32 dequantization (shift, mask, magic OR,
subtract, scale, FMA). awq_gemm (up to LINEAR_GEMM_ROWS rows in awq_linear) dequantizes each
[BLOCK_K, BLOCK_N] weight tile to x's dtype and feeds it to tl.dot, fp32 accumulation; there
nibbles become floats ORed into the mantissa of 2**23 (_as_float), and q - z is then a float32
subtraction. Past LINEAR_GEMM_ROWS rows (prefill, large batches) awq_linear dequantizes the
whole weight to x's dtype (awq_dequantize, with the GEMV's offsets) and leaves the product to
cuBLAS: the tile dequantization inside awq_gemm holds it to 41-44% of cuBLAS bf16, the weight's
extra round trip through memory costs less than that from ~128-256 rows on.

The K-major layout makes a weight row of one program's columns only BLOCK_N / 2 bytes, so at a
few rows the output columns alone give too few programs to stream the weight at the memory's
bandwidth (N = 4096 in 512-column blocks is 8 programs). Both kernels therefore split K when
the grid would not fill the GPU: each split writes fp32 partial sums and a second launch adds
them in a fixed order. No atomics: the output is deterministic for a given split.

Every K tile lies inside one group (G % BLOCK_K == 0), so a tile needs one row of scales and
zeros, and K needs no masks (K % G == 0).
"""

import math

import torch
import triton
import triton.language as tl

from echo_kernels.activation import silu_and_mul, silu_times
from echo_kernels.device import sm_count
from echo_kernels.pdl import pdl_options, wait_for_inputs

GEMV_MAX_ROWS = 16  # the most rows awq_gemv takes
# awq_linear's switch to the tensor-core kernel: with two rows a program the GEMV took a layer's
# four GEMMs in 76.7 us at 2 rows and 124.6 at 4, against 148.5 and 155.9 for awq_gemm's one
# 16-row tile; at 8 rows 208.7 against 156.3 (H200, Llama-3.1-8B's layers, docs/benchmarks.md
# AWQ, 2026-12-04)
LINEAR_GEMV_ROWS = 4
# awq_linear's switch from awq_gemm to a dense weight (awq_dequantize) and cuBLAS: the
# dequantization writes 2 bytes a weight and cuBLAS reads them back, a fixed cost (gate_up
# ~145 us) that awq_gemm's row tiles pass between 128 and 256 rows (H200, Llama-3.1-8B's four
# layers in CUDA graphs, tools/dev/probe_awq_gemm_rows.py: with one row tile of 64 or 128 rows
# 212 against 272 us at 64 rows, 246 against 328 at 128, 444 against 331 at 256; 89-95% of
# cuBLAS bf16 at 4096 against awq_gemm's 41-44%; docs/benchmarks.md AWQ, 2026-12-04)
LINEAR_GEMM_ROWS = 128
# rows and columns a program of awq_dequantize (8 KB read, 16 KB written in bf16); untuned
_DEQUANTIZE_BLOCK_K, _DEQUANTIZE_BLOCK_N = 8, 1024
# programs to aim for per SM: a decode GEMV needs several in flight to cover memory latency, and
# so does the GEMM at decode rows (DECODE_ROWS); a larger GEMM splits only a grid under one
# wave (its partial sums cost M*N*4 bytes a split each way)
_GEMV_PROGRAMS_PER_SM = 8
_GEMM_PROGRAMS_PER_SM = 1
_GEMM_DECODE_PROGRAMS_PER_SM = 4  # the sweep's best splits gave 2-7 programs per SM
_DECODE_ROWS = 64
# the GEMV's defaults, from bench_kernels' sweep at M = 1 (H200, 2026-12-04, docs/benchmarks.md
# AWQ): tiles of 8 rows by 512 columns (two packs a lane of one warp), 3 stages, and splits for
# ~8 programs an SM but no more than ~128 rows each (gate_up's best took 37 splits of 110 rows
# where 8 an SM gave it 18)
_GEMV_BLOCK_N = 512
_GEMV_BLOCK_K = 8
_GEMV_WARPS = 1
_GEMV_STAGES = 3
_GEMV_SPLIT_ROWS = 128
_ONE_BITS = 0x3F800000  # float32 1.0
# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)), first match wins; BLOCK_K is capped by
# the group size. Decode rows from the H200: bench_kernels' sweep (2026-12-02: 16 x 128 x 64
# best for all four Llama-3.1-8B shapes at 16 rows) and tools/dev/probe_awq_gemm_rows.py
# (2026-12-04: at 32 rows one 32-row tile took a layer's four GEMMs in 194.4 us against 284.3
# for two 16-row tiles; at 64 rows one 64-row tile 212.1 against 335.9 for the 32-row one; at
# 128 and 256 rows 128 x 256 x 128 on 8 warps, 246.4 and 443.7 against 415.0 and 723.4 for
# 64 x 128 x 64); M = 4096 at 128 x 256 x 128 (1.41-1.46x the earlier 128 x 128 x 64)
_GEMM_CONFIGS = (
    (16, (16, 128, 64, 4)),
    (32, (32, 128, 64, 4)),
    (_DECODE_ROWS, (64, 128, 64, 4)),
    (None, (128, 256, 128, 8)),
)
_SUM_ELEMENTS = 2048  # partial sums a program of _split_sum_kernel adds


def _gemm_config(num_rows: int) -> tuple[int, int, int, int]:
    for most, config in _GEMM_CONFIGS:
        if most is None or num_rows <= most:
            return config
    raise AssertionError("unreachable")


@triton.jit
def nibble_shift(cols):
    """The bit offset of output column c inside its packed int32 c // 8 (4 *
    AWQ_REVERSE_ORDER[c % 8])."""
    r = cols % 8
    return (r // 2) * 4 + (r % 2) * 16


@triton.jit
def _nibble_shifts():
    """[8] int32: nibble_shift of columns 8j + 0..7."""
    return nibble_shift(tl.arange(0, 8))


@triton.jit
def _as_float(nibbles):
    """int32 values 0..15 -> float32 2**23 + value: the nibble ORed into the mantissa of 2**23,
    no int-to-float conversion (a quarter-rate instruction on the GPU)."""
    return (nibbles | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequantize(packed, qzeros_ptr, scales_ptr, group, packs, cols, n_packed, N, shifts):
    """packed int32 [BLOCK_K, P] of one group -> its weights [8, BLOCK_K, P] float32, [r, k, j]
    being column 8j + r. (2**23 + q) - (2**23 + z) is q - z exactly, and (q - z) * s is exact
    for fp16/bf16 scales (4 + 11 significant bits)."""
    # NOTE: the nibble axis leads: Triton lays threads out from the last axis, so the eight
    # values of one int32 stay in one thread's registers and each int32 is loaded by one lane
    pack_ok = packs < n_packed
    zeros = tl.load(qzeros_ptr + group * n_packed + packs, mask=pack_ok, other=0)
    z = _as_float((zeros[None, :] >> shifts[:, None]) & 0xF)  # [8, P]
    s = tl.load(scales_ptr + group * N + cols, mask=pack_ok[None, :], other=0.0).to(tl.float32)
    q = _as_float((packed[None, :, :] >> shifts[:, None, None]) & 0xF)  # [8, BLOCK_K, P]
    return (q - z[:, None, :]) * s[:, None, :]


@triton.jit
def _offset_window(word, LOW: tl.constexpr, one_bits):
    """The nibble q at bits LOW..LOW+3 of each int32 (LOW 15 or 19) -> float32 1 + q * 2**(LOW
    - 23): the nibble ORed into the mantissa of 1.0 (one_bits, 0x3F800000, comes in as an
    argument so the mask and the OR compile to one LOP3: an instruction holds one immediate)."""
    return ((word & (0xF << LOW)) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_offsets(packed, one_bits):
    """AWQ int32 [..., P] -> float32 [..., P, 2, 2, 2], whose row-major [..., j, r] (r < 8) is
    1 + q * u of column 8j + r, the unit u being 2**-8 for r in (0, 1, 4, 5) and 2**-4 for r in
    (2, 3, 6, 7) (_inverse_units). Four shifts a word: each brings a pair of nibbles four bits
    apart to bits 15 and 19."""
    # column r sits at bit 4 * (r // 2) + 16 * (r % 2): r = 0, 2, 4, 6 at 0, 4, 8, 12 and
    # r = 1, 3, 5, 7 at 16, 20, 24, 28
    low = packed << 15  # bits 0, 4 -> 15, 19
    mid_low = packed << 7  # 8, 12
    mid_high = packed >> 1  # 16, 20 (the sign bits an arithmetic shift brings are masked off)
    high = packed >> 9  # 24, 28
    c0 = _offset_window(low, 15, one_bits)
    c2 = _offset_window(low, 19, one_bits)
    c4 = _offset_window(mid_low, 15, one_bits)
    c6 = _offset_window(mid_low, 19, one_bits)
    c1 = _offset_window(mid_high, 15, one_bits)
    c3 = _offset_window(mid_high, 19, one_bits)
    c5 = _offset_window(high, 15, one_bits)
    c7 = _offset_window(high, 19, one_bits)
    return _in_column_order(c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def _in_column_order(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight [...] tensors, those of column r = 0..7 of each pack -> [..., 2, 2, 2] whose
    row-major index is r."""
    # tl.join(a, b) adds a trailing axis of 2 holding a then b, so three joins give [..., 2, 2,
    # 2] whose row-major index is 4 * (the first join's axis) + 2 * (the second's) + the third's:
    # the first joins pair r with r + 4, the second r with r + 2, the last even with odd
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                   tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _inverse_units(cols):
    """1 / u of each column, u as in _unpack_offsets: 256 where (column // 2) is even, else 16."""
    return tl.where((cols // 2) % 2 == 0, 256.0, 16.0)


@triton.jit
def _group_offsets(qzeros_ptr, scales_ptr, group, packs, pack_ok, cols, N, n_packed, one_bits):
    """Group `group`'s zero points as offsets z' = 1 + z u (_unpack_offsets) and its scales
    over u, s / u, both float32 [BLOCK_N] for the columns of `packs`: (w - z') s / u is then
    (q - z) s for a weight w = 1 + q u."""
    zeros = tl.load(qzeros_ptr + group * n_packed + packs, mask=pack_ok, other=0)
    z = tl.reshape(_unpack_offsets(zeros, one_bits), cols.shape)
    s = tl.load(scales_ptr + group * N + cols, mask=cols < N, other=0.0)
    return z, s.to(tl.float32) * _inverse_units(cols)


# NOTE: n_packed is left unspecialised so that its alignment stays unknown: a row of packed
# int32 then loads 4 bytes a thread, one pack a lane, and Triton's layout keeps a tile's BLOCK_K
# rows of a pack in one thread, where the sum over K needs no other thread. With 16-byte loads it
# spread the rows over lanes and warps, and the sums had to stay per row until the end (224
# registers a thread at 16 x 256 and 2 warps, against 96 now at 1 warp)
@triton.jit(do_not_specialize=["n_packed", "M"])
def _awq_gemv_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K, N // 8] int32
    qzeros_ptr,  # [K // G, N // 8] int32
    scales_ptr,  # [K // G, N]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M,
    N,
    n_packed,  # N // 8, the row stride of qweight and qzeros
    K,
    tiles_per_split,
    stride_xm,
    stride_om,
    stride_os,  # between splits of out (0 when there is one)
    one_bits,  # 0x3F800000, float32 1.0's bits (see _offset_window)
    GROUP: tl.constexpr,  # the group size G
    BLOCK_N: tl.constexpr,  # a power of two >= 8; 256 a warp keeps a pack a lane
    BLOCK_K: tl.constexpr,  # divides G
    PAIR: tl.constexpr,  # two rows of x a program, each weight unpacked once for both
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks on the weight
    NUM_STAGES: tl.constexpr,  # weight tiles in flight (Triton's pipeliner, cp.async)
    EXACT: tl.constexpr,  # float32 x: take the 1 off each weight (see below)
    USE_PDL: tl.constexpr,
):
    # Per group g and column n the result is s * sum_k x_k (q_k - z). Each weight becomes
    # w = 1 + q u (an OR into 1.0's mantissa: no conversion, no subtraction, no scale multiply
    # per weight) and the loop accumulates A = sum_k x_k w_k (FMAs down a pack's rows in one
    # thread) beside S = sum_k x_k. As z' = 1 + z u, sum_k x_k (q_k - z) = (A - z' S) / u,
    # folded into the total once a group. Exactness: 1 + q u has at most 9 significant bits, so
    # x w is exact for fp16/bf16 x; A rounds in float32 relative to its size (~ a group of
    # |x|), which / u (256 at most) leaves ~2**-16 of that, below fp16's own rounding of x. For
    # float32 x that would be coarser than x itself: EXACT subtracts the 1 from each weight (one
    # more instruction a weight), so A = u sum_k x_k q_k carries no offset and z' becomes z u.
    # With PAIR the second row (x2, acc2, ...) repeats the first's sums over the same w: the
    # unpacking, about 1.5 instructions of a weight's 2.5, is shared
    PACKS: tl.constexpr = BLOCK_N // 8
    TILES: tl.constexpr = GROUP // BLOCK_K  # tiles a group
    packs = tl.program_id(0) * PACKS + tl.arange(0, PACKS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pack_ok = packs < n_packed
    split = tl.program_id(1)
    row = tl.program_id(2) * (2 if PAIR else 1)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, K // BLOCK_K)
    offs_k = first_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    qw_ptrs = qweight_ptr + offs_k[:, None].to(tl.int64) * n_packed + packs[None, :]
    x_ptrs = x_ptr + row * stride_xm + offs_k
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    x_sum = tl.zeros([1], dtype=tl.float32)
    wait_for_inputs(USE_PDL)
    # NOTE: x is loaded one tile ahead by hand: its load is too narrow for the pipeliner's
    # cp.async, and loaded where it is used each tile waited for it
    x_next = tl.load(x_ptrs)
    if PAIR:
        has_row2 = (row + 1 < M) & (offs_k >= 0)  # [BLOCK_K]: a last row of odd M has none
        total2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        x_sum2 = tl.zeros([1], dtype=tl.float32)
        x_next2 = tl.load(x_ptrs + stride_xm, mask=has_row2, other=0.0)
    for tile in tl.range(first_tile, end_tile, num_stages=NUM_STAGES):
        x = x_next.to(tl.float32)
        x_ptrs += BLOCK_K
        x_next = tl.load(x_ptrs, mask=tile + 1 < end_tile, other=0.0)
        if PAIR:
            x2 = x_next2.to(tl.float32)
            x_next2 = tl.load(x_ptrs + stride_xm, mask=has_row2 & (tile + 1 < end_tile),
                              other=0.0)
        if EVEN_N:
            packed = tl.load(qw_ptrs)
        else:
            packed = tl.load(qw_ptrs, mask=pack_ok[None, :], other=0)
        w = tl.reshape(_unpack_offsets(packed, one_bits), (BLOCK_K, BLOCK_N))
        if EXACT:
            w -= 1.0
        acc += tl.sum(x[:, None] * w, axis=0)
        x_sum += tl.sum(x, axis=0)
        if PAIR:
            acc2 += tl.sum(x2[:, None] * w, axis=0)
            x_sum2 += tl.sum(x2, axis=0)
        # a group's last tile, or the split's: fold the group's sums into the total (the
        # identity holds for any part of a group, so splits need not align with groups)
        if (tile % TILES == TILES - 1) | (tile == end_tile - 1):
            z, s_u = _group_offsets(qzeros_ptr, scales_ptr, tile // TILES, packs, pack_ok,
                                    cols, N, n_packed, one_bits)
            if EXACT:
                z -= 1.0
            total += s_u * (acc - z * x_sum)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([1], dtype=tl.float32)
            if PAIR:
                total2 += s_u * (acc2 - z * x_sum2)
                acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
                x_sum2 = tl.zeros([1], dtype=tl.float32)
        qw_ptrs += BLOCK_K * n_packed
    out = out_ptr + split.to(tl.int64) * stride_os + row * stride_om + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=cols < N)
    if PAIR:
        tl.store(out + stride_om, total2.to(out_ptr.dtype.element_ty),
                 mask=(cols < N) & (row + 1 < M))


@triton.jit
def gemm_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of this program: programs in runs of GROUP_M row tiles down each
    column of tiles, so that consecutive programs reuse one weight tile (dequantized again by
    each, but read from memory once)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    per_run = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = pid // per_run * GROUP_M
    run_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + pid % per_run % run_rows, pid % per_run // run_rows


# NOTE: M is the batch's token count; left to specialise (M == 1, M % 16 == 0) a prefill of a new
# length could compile the kernel again mid-serving. Its value only bounds masks
@triton.jit(do_not_specialize=["M"])
def _awq_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K, N // 8] int32
    qzeros_ptr,  # [K // G, N // 8] int32
    scales_ptr,  # [K // G, N]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M,
    N,
    K,
    n_packed,  # N // 8, as in _awq_gemv_kernel
    group_size,
    k_per_split,
    stride_xm,
    stride_om,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides the group size, at least 16
    GROUP_M: tl.constexpr,  # row tiles launched together, sharing their weight tiles in L2
    PRECISION: tl.constexpr,  # tl.dot's input_precision ("ieee" for float32 inputs)
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    PACKS: tl.constexpr = BLOCK_N // 8
    pid_m, pid_n = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    shifts = _nibble_shifts()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    packs = pid_n * PACKS + tl.arange(0, PACKS)
    cols = packs[None, :] * 8 + tl.arange(0, 8)[:, None]  # [8, PACKS]
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    qw_ptrs = qweight_ptr + offs_k[:, None].to(tl.int64) * n_packed + packs[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        packed = tl.load(qw_ptrs, mask=packs[None, :] < n_packed, other=0)
        w = _dequantize(packed, qzeros_ptr, scales_ptr, k0 // group_size, packs, cols,
                        n_packed, N, shifts)
        # [8, BLOCK_K, PACKS] -> [BLOCK_K, PACKS, 8] -> [BLOCK_K, BLOCK_N], row-major:
        # [k, j, r] is column 8j + r
        w = tl.reshape(tl.permute(w.to(x_ptr.dtype.element_ty), (1, 2, 0)),
                       (BLOCK_K, BLOCK_N))
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K * n_packed
    out = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
           + out_cols[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (out_cols[None, :] < N))


@triton.jit
def _split_sum(partial_ptr, src, ok, splits, num_splits, stride_split, dtype: tl.constexpr):
    """The sum over splits of the partials at offsets src [BLOCK] (where ok), in dtype."""
    mask = (splits[:, None] < num_splits) & ok[None, :]
    parts = tl.load(partial_ptr + splits[:, None].to(tl.int64) * stride_split + src[None, :],
                    mask=mask, other=0.0)
    return tl.sum(parts, axis=0).to(dtype)


@triton.jit
def _split_sum_kernel(
    partial_ptr,  # [num_splits, M, N] float32
    out_ptr,  # [M, N], or [M, N / 2] (SWIGLU), contiguous
    numel,  # outputs: M * N, or M * N / 2
    num_splits,
    half,  # N / 2 (SWIGLU)
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK: tl.constexpr,
    SWIGLU: tl.constexpr,  # N columns of gate, then up: store silu(gate) * up
    USE_PDL: tl.constexpr,
):
    # NOTE: every split's partials load at once, one memory latency: a loop over the splits
    # waited one latency per split (16 splits took ~8 us of a 13 us o_proj GEMV on the H200).
    # tl.sum's order is fixed by the shapes, so the result is deterministic
    wait_for_inputs(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS)
    ok = offs < numel
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if SWIGLU:
        # output (row, j) is silu(gate j) * up j, gate and up rounded as stored outputs are
        gate = offs // half * (2 * half) + offs % half
        stride = 2 * numel
        out = silu_times(_split_sum(partial_ptr, gate, ok, splits, num_splits, stride, dtype),
                         _split_sum(partial_ptr, gate + half, ok, splits, num_splits, stride,
                                    dtype))
    else:
        out = _split_sum(partial_ptr, offs, ok, splits, num_splits, numel, dtype)
    tl.store(out_ptr + offs, out.to(dtype), mask=ok)


@triton.jit(do_not_specialize=["n_packed"])
def _awq_dequantize_kernel(
    qweight_ptr,  # [K, N // 8] int32
    qzeros_ptr,  # [K // G, N // 8] int32
    scales_ptr,  # [K // G, N]
    out_ptr,  # [K, N]
    N,
    n_packed,
    one_bits,  # as in _awq_gemv_kernel
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP
):
    # The GEMV's offsets: w = 1 + q u and z' = 1 + z u differ by (q - z) u exactly (nine
    # significant bits each), and s / u is exact (u a power of two), so (w - z') * (s / u) is
    # (q - z) * s rounded once in float32, as the reference computes it
    packs = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    group = tl.program_id(1) * BLOCK_K // GROUP
    pack_ok = packs < n_packed
    packed = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * n_packed + packs[None, :],
                     mask=pack_ok[None, :], other=0)
    w = tl.reshape(_unpack_offsets(packed, one_bits), (BLOCK_K, BLOCK_N))
    z, s_u = _group_offsets(qzeros_ptr, scales_ptr, group, packs, pack_ok, cols, N, n_packed,
                            one_bits)
    out = (w - z[None, :]) * s_u[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=cols[None, :] < N)


def _check(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           group_size: int) -> tuple[int, int, int]:
    """(M, K, N) of a valid call."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with a contiguous K"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    m, k = x.shape
    return m, k, _check_weight(qweight, qzeros, scales, group_size, k)


def _check_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int, k: int) -> int:
    """N of a valid AWQ weight with K = k."""
    n = qweight.shape[1] * 8
    assert qweight.dtype == qzeros.dtype == torch.int32
    assert scales.is_floating_point()
    assert group_size >= 1 and k % group_size == 0, f"K={k} is not a multiple of G={group_size}"
    groups = k // group_size
    assert qweight.shape == (k, n // 8), f"qweight {tuple(qweight.shape)} for K={k}"
    assert qzeros.shape == (groups, n // 8), f"qzeros {tuple(qzeros.shape)} for K/G={groups}"
    assert scales.shape == (groups, n), f"scales {tuple(scales.shape)} for [{groups}, {n}]"
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    return n


def _block_k(group_size: int, want: int) -> int:
    """The largest power of two <= want that divides the group size."""
    return math.gcd(group_size, 1 << (want.bit_length() - 1))


def _num_splits(split_k: int | None, programs: int, k_tiles: int, per_sm: int,
                device: torch.device, at_least: int = 1) -> tuple[int, int]:
    """(splits, K tiles per split), every split non-empty. By default: enough splits to give
    each SM `per_sm` programs, and at least `at_least`."""
    if split_k is None:
        split_k = max(1, at_least, per_sm * sm_count(device, without_gpu=2) // programs)
    assert split_k >= 1
    tiles = triton.cdiv(k_tiles, min(split_k, k_tiles))
    return triton.cdiv(k_tiles, tiles), tiles


def _launch_split(launch, num_splits: int, m: int, n: int, x: torch.Tensor, pdl: dict,
                  swiglu: bool = False) -> torch.Tensor:
    """The product [m, n] in x's dtype: launch(target, stride between splits) straight into
    it, or into float32 partials that a second launch sums; swiglu: [m, n / 2], silu(gate) *
    up of the product's halves (in that second launch, or after the one launch)."""
    if num_splits == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        launch(out, 0)
        return silu_and_mul(out) if swiglu else out
    out = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    partial = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
    launch(partial, m * n)
    splits = triton.next_power_of_2(num_splits)
    block = max(32, _SUM_ELEMENTS // splits)
    _split_sum_kernel[(triton.cdiv(out.numel(), block),)](
        partial, out, out.numel(), num_splits, n // 2, SPLITS=splits, BLOCK=block,
        SWIGLU=swiglu, **pdl, num_warps=4)
    return out


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_n: int | None = None,
             block_k: int | None = None, split_k: int | None = None,
             num_warps: int = _GEMV_WARPS, num_stages: int = _GEMV_STAGES,
             programs_per_sm: int = _GEMV_PROGRAMS_PER_SM,
             pair_rows: bool | None = None, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ AWQ weight [K, N] -> [M, N] in x's dtype; swiglu: the
    weight is SwiGLU's [gate, up] and the result silu(x @ gate) * (x @ up), [M, N / 2], computed
    where the splits' partial sums are added (no launch of its own).

    CUDA-core math in float32 (see _awq_gemv_kernel); a program takes one row, or two with
    pair_rows (None: when M > 1), and each program reads the weight again (from L2 when they
    run together). block_n: output columns a program (a power of two >= 8); block_k: K per
    step, a power of two dividing group_size; split_k: K ranges (None: enough for
    programs_per_sm programs an SM, at most _GEMV_SPLIT_ROWS rows each; 1: one launch, no
    partial sums); num_stages: weight tiles in flight.
    """
    m, k, n = _check(x, qweight, qzeros, scales, group_size)
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"awq_gemv takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    block_n = block_n or _GEMV_BLOCK_N
    block_k = block_k or _block_k(group_size, _GEMV_BLOCK_K)
    assert block_n >= 8 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 8"
    assert group_size % block_k == 0 and block_k & (block_k - 1) == 0, \
        f"block_k={block_k} must be a power of two dividing group_size={group_size}"
    pair = m > 1 if pair_rows is None else pair_rows
    row_programs = triton.cdiv(m, 2) if pair else m
    programs = triton.cdiv(n, block_n) * row_programs
    num_splits, tiles = _num_splits(split_k, programs, k // block_k, programs_per_sm,
                                    x.device, at_least=k // _GEMV_SPLIT_ROWS)
    pdl = pdl_options(x.device)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_gemv_kernel[(triton.cdiv(n, block_n), num_splits, row_programs)](
            x, qweight, qzeros, scales, target, m, n, n // 8, k, tiles, x.stride(0), n,
            stride_split, _ONE_BITS, GROUP=group_size, BLOCK_N=block_n,
            BLOCK_K=block_k, PAIR=pair, EVEN_N=n % block_n == 0, NUM_STAGES=num_stages,
            EXACT=x.dtype == torch.float32, **pdl,
            num_warps=num_warps, num_stages=num_stages)

    return _launch_split(launch, num_splits, m, n, x, pdl, swiglu)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
             group_m: int = 8, num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ AWQ weight [K, N] -> [M, N] in x's dtype, on the tensor cores.

    Each weight tile is dequantized in float32 and rounded once to x's dtype before tl.dot
    (input_precision "ieee" for float32 x); fp32 accumulation.
    Tiles default to a config picked by M; block_k (at least 16) must divide group_size;
    split_k as in awq_gemv.
    """
    m, k, n = _check(x, qweight, qzeros, scales, group_size)
    if not m:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    tile_m, tile_n, tile_k, warps = _gemm_config(m)
    block_m = block_m or tile_m
    block_n = block_n or tile_n
    block_k = block_k or _block_k(group_size, tile_k)
    num_warps = num_warps or warps
    assert block_n % 8 == 0 and block_n >= 16 and block_m >= 16
    assert group_size % block_k == 0 and block_k >= 16 and block_k & (block_k - 1) == 0, \
        f"block_k={block_k} must be a power of two >= 16 dividing group_size={group_size}"
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    per_sm = _GEMM_DECODE_PROGRAMS_PER_SM if m <= _DECODE_ROWS else _GEMM_PROGRAMS_PER_SM
    num_splits, tiles = _num_splits(split_k, programs, k // block_k, per_sm, x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_options(x.device)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_gemm_kernel[(programs, num_splits)](
            x, qweight, qzeros, scales, target, m, n, k, n // 8, group_size, tiles * block_k,
            x.stride(0), n, stride_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            GROUP_M=group_m, PRECISION=precision, **pdl,
            num_warps=num_warps, num_stages=num_stages)

    return _launch_split(launch, num_splits, m, n, x, pdl)


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The AWQ weight as a dense [K, N] in dtype: (q - z) * s in float32, rounded once."""
    k = qweight.shape[0]
    n = _check_weight(qweight, qzeros, scales, group_size, k)
    out = torch.empty(k, n, dtype=dtype, device=qweight.device)
    block_n, block_k = _DEQUANTIZE_BLOCK_N, _block_k(group_size, _DEQUANTIZE_BLOCK_K)
    _awq_dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](
        qweight, qzeros, scales, out, n, n // 8, _ONE_BITS, GROUP=group_size, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=4)
    return out


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, group_size: int, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] @ the AWQ weight [K, N] -> [M, N] in x's dtype: awq_gemv up to
    LINEAR_GEMV_ROWS rows, awq_gemm up to LINEAR_GEMM_ROWS, and from there the weight
    dequantized whole (awq_dequantize) and multiplied by cuBLAS. Groups under 16 rows, which
    tl.dot cannot step through, skip awq_gemm: the GEMV up to GEMV_MAX_ROWS, then the dense
    weight. swiglu: silu(gate) * up of the product's halves, [M, N / 2] (inside awq_gemv's
    split sum; after the others)."""
    tensor_cores = group_size >= 16
    if 1 <= x.shape[0] <= (LINEAR_GEMV_ROWS if tensor_cores else GEMV_MAX_ROWS):
        return awq_gemv(x, qweight, qzeros, scales, group_size, swiglu=swiglu)
    if x.shape[0] <= LINEAR_GEMM_ROWS and tensor_cores:
        y = awq_gemm(x, qweight, qzeros, scales, group_size)
    else:
        y = x @ awq_dequantize(qweight, qzeros, scales, group_size, x.dtype)
    return silu_and_mul(y) if swiglu else y
