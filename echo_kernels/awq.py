"""AWQ W4A16 linear layers: y[M, N] = x[M, K] @ W[N, K]^T, W dequantized from 4-bit on chip.

The weights come in echo's layout (echo/layers/awq_layout.py), per layer of K inputs, N outputs
and group size G:

    qweight int32 [N, K // 8]   eight 4-bit values per int32 along the inputs
    qzeros  uint8 [N, K // G]
    scales        [N, K // G]

    W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G]

Input 8p + r of a row sits at nibble AWQ_REVERSE_ORDER[r] = [0, 4, 1, 5, 2, 6, 3, 7][r] of its
int32 p (AutoAWQ's interleaved order, kept from its checkpoints), i.e. at bit 4 * (r // 2) + 16
* (r % 2). An int32 whose top nibble is 8 or more is negative; every shift is masked with 0xF,
so the sign does not matter.

Up to LINEAR_GEMV_ROWS rows awq_linear runs the one-row GEMV (echo_kernels/linear.py with these
operands, awq_gemv): a program owns whole output rows over all of K and works on the CUDA cores
without dequantizing: each weight becomes the float 1 + q * u by one shift and one bitwise op
into the mantissa of 1.0 (_unpack_offsets), x is scaled by 1 / u once, and the zero and scale
enter once a group (awq_rows_dot has the algebra): about 2.5 instructions a weight. awq_gemm (up
to LINEAR_GEMM_ROWS rows) dequantizes each [BLOCK_N, BLOCK_K] weight tile to x's dtype and feeds
it to tl.dot, fp32 accumulation, splitting K where the grid would not fill the GPU (fp32 partial
sums, added in a fixed order by a second launch: deterministic). Past LINEAR_GEMM_ROWS rows
(prefill, large batches) awq_linear dequantizes the whole weight to x's dtype (awq_dequantize)
and leaves the product to cuBLAS: the tile dequantization inside awq_gemm held it to 41-44% of
cuBLAS bf16, the weight's extra round trip through memory costs less than that from ~128-256
rows on.

Every K tile lies inside one group (G % BLOCK_K == 0), so a tile needs one scale and zero a row,
and K needs no masks (K % G == 0). G is a multiple of 8: a pack never straddles two groups.
"""

import math

import torch
import triton
import triton.language as tl

from echo_kernels.device import sm_count
from echo_kernels.pdl import pdl_options, wait_for_inputs

# awq_linear's switch from the one-row GEMV to the tensor-core kernel: the GEMV's accumulator
# and x grow with the rows (linear.MAX_ROWS)
LINEAR_GEMV_ROWS = 4
# awq_linear's switch from awq_gemm to a dense weight (awq_dequantize) and cuBLAS: the
# dequantization writes 2 bytes a weight and cuBLAS reads them back, a fixed cost (gate_up
# ~145 us) that awq_gemm's row tiles pass between 128 and 256 rows (H200, Llama-3.1-8B's four
# layers in CUDA graphs, tools/dev/probe_awq_gemm_rows.py: with one row tile of 64 or 128 rows
# 212 against 272 us at 64 rows, 246 against 328 at 128, 444 against 331 at 256; 89-95% of
# cuBLAS bf16 at 4096 against awq_gemm's 41-44%; docs/benchmarks.md AWQ, 2026-12-04; measured
# in AutoAWQ's K-major layout)
LINEAR_GEMM_ROWS = 128
# weights a program of awq_dequantize (8 KB read at G = 128, 16 KB written in bf16); untuned
_DEQUANTIZE_WEIGHTS = 8192
# programs to aim for per SM: the GEMM at decode rows (DECODE_ROWS) needs several in flight to
# cover memory latency; a larger GEMM splits only a grid under one wave (its partial sums cost
# M*N*4 bytes a split each way)
_GEMM_PROGRAMS_PER_SM = 1
_GEMM_DECODE_PROGRAMS_PER_SM = 4  # the sweep's best splits gave 2-7 programs per SM
_DECODE_ROWS = 64
# bytes of packed weight a program of the one-row GEMV holds (its whole share, loaded before the
# PDL wait as a dense layer's whole-K tile is): 32 registers a thread at 4 warps
GEMV_SHARE_BYTES = 16384
ONE_BITS = 0x3F800000  # float32 1.0
# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)), first match wins; BLOCK_K is capped by
# the group size. Decode rows from the H200: bench_kernels' sweep (2026-12-02: 16 x 128 x 64
# best for all four Llama-3.1-8B shapes at 16 rows) and tools/dev/probe_awq_gemm_rows.py
# (2026-12-04: at 32 rows one 32-row tile took a layer's four GEMMs in 194.4 us against 284.3
# for two 16-row tiles; at 64 rows one 64-row tile 212.1 against 335.9 for the 32-row one; at
# 128 and 256 rows 128 x 256 x 128 on 8 warps, 246.4 and 443.7 against 415.0 and 723.4 for
# 64 x 128 x 64); M = 4096 at 128 x 256 x 128 (1.41-1.46x the earlier 128 x 128 x 64). All
# measured in AutoAWQ's K-major layout
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
def _offset_window(word, LOW: tl.constexpr, one_bits):
    """The nibble q at bits LOW..LOW+3 of each int32 (LOW 15 or 19) -> float32 1 + q * 2**(LOW
    - 23): the nibble ORed into the mantissa of 1.0 (one_bits, 0x3F800000, comes in as an
    argument so the mask and the OR compile to one LOP3: an instruction holds one immediate)."""
    return ((word & (0xF << LOW)) | one_bits).to(tl.float32, bitcast=True)


@triton.jit
def _unpack_offsets(packed, one_bits):
    """AWQ int32 [..., P] -> float32 [..., P, 2, 2, 2], whose row-major [..., j, r] (r < 8) is
    1 + q * u of value 8j + r, the unit u being 2**-8 for r in (0, 1, 4, 5) and 2**-4 for r in
    (2, 3, 6, 7) (_inverse_units). Four shifts a word: each brings a pair of nibbles four bits
    apart to bits 15 and 19."""
    # value r sits at bit 4 * (r // 2) + 16 * (r % 2): r = 0, 2, 4, 6 at 0, 4, 8, 12 and
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
    """Eight [...] tensors, those of value r = 0..7 of each pack -> [..., 2, 2, 2] whose
    row-major index is r."""
    # tl.join(a, b) adds a trailing axis of 2 holding a then b, so three joins give [..., 2, 2,
    # 2] whose row-major index is 4 * (the first join's axis) + 2 * (the second's) + the third's:
    # the first joins pair r with r + 4, the second r with r + 2, the last even with odd
    return tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                   tl.join(tl.join(c1, c5), tl.join(c3, c7)))


@triton.jit
def _inverse_units(offs):
    """1 / u of the values at offsets offs of a row (u as in _unpack_offsets, by the offset's
    place in its pack): 256 where (offset // 2) is even, else 16."""
    return tl.where((offs // 2) % 2 == 0, 256.0, 16.0)


@triton.jit
def load_awq_rows(qweight_ptr, qzeros_ptr, scales_ptr, rows, N, K, stride_wn,
                  GROUP: tl.constexpr, GROUPS: tl.constexpr, EVEN: tl.constexpr):
    """Weight rows `rows` [BLOCK_N] over all of K, for awq_rows_dot: (packed int32 [BLOCK_N,
    GROUPS, GROUP / 8], zero points and scales [BLOCK_N, GROUPS]); GROUPS, a power of two, is at
    least K / GROUP, and what lies past K or N loads as 0 unless EVEN says nothing does."""
    PACKS: tl.constexpr = GROUP // 8
    n_groups = K // GROUP
    groups = tl.arange(0, GROUPS)
    row_starts = rows[:, None, None].to(tl.int64) * stride_wn
    offs = row_starts + groups[None, :, None] * PACKS + tl.arange(0, PACKS)[None, None, :]
    meta = rows[:, None] * n_groups + groups[None, :]
    if EVEN:
        packed = tl.load(qweight_ptr + offs)
        zeros = tl.load(qzeros_ptr + meta)
        scales = tl.load(scales_ptr + meta)
    else:
        ok = (rows[:, None] < N) & (groups[None, :] < n_groups)
        packed = tl.load(qweight_ptr + offs, mask=ok[:, :, None], other=0)
        zeros = tl.load(qzeros_ptr + meta, mask=ok, other=0)
        scales = tl.load(scales_ptr + meta, mask=ok, other=0.0)
    return packed, zeros, scales


@triton.jit
def awq_rows_dot(x_ptr, stride_xm, M, K, packed, zeros, scales, one_bits,
                 M_PAD: tl.constexpr, EXACT: tl.constexpr, NORM: tl.constexpr = False,
                 HAS_RESIDUAL: tl.constexpr = False, resid_ptr=None, norm_w_ptr=None,
                 rstd=None):
    """x [M, K] (rows of stride stride_xm) times the weight rows of load_awq_rows -> float32
    [M_PAD, BLOCK_N]. NORM: RMSNorm(x + residual) in place of x, the rows' rstd [M_PAD] given,
    rounded as linear._normed_rows rounds it.

    Per group g and row n the result is s * sum_k x_k (q_k - z). Each weight becomes w = 1 + q u
    (an OR into 1.0's mantissa: no conversion, no subtraction, no scale multiply a weight), u
    set by the value's place in its pack, so x is scaled by 1 / u (x' = x / u, exact) and the
    sum is B = sum_k x'_k w_k = S' + sum_k x_k q_k, S' = sum_k x'_k; with S = sum_k x_k the
    group adds s (B - S' - z S). Exactness: x' w is exact for fp16/bf16 x (9 significant bits
    in w), and B rounds in float32 relative to S' (~256 |x| a group), ~2**-16 of it, below
    fp16's rounding of x. For float32 x that would be coarser than x itself: EXACT subtracts
    the 1 from each weight (one more instruction a weight) so that B = sum_k x_k q_k."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    GROUPS: tl.constexpr = packed.shape[1]
    PACKS: tl.constexpr = packed.shape[2]
    # the eight values of each pack as eight tensors [BLOCK_N, GROUPS, PACKS], 1 + q u each
    low = packed << 15
    mid_low = packed << 7
    mid_high = packed >> 1
    high = packed >> 9
    w0 = _offset_window(low, 15, one_bits)
    w2 = _offset_window(low, 19, one_bits)
    w4 = _offset_window(mid_low, 15, one_bits)
    w6 = _offset_window(mid_low, 19, one_bits)
    w1 = _offset_window(mid_high, 15, one_bits)
    w3 = _offset_window(mid_high, 19, one_bits)
    w5 = _offset_window(high, 15, one_bits)
    w7 = _offset_window(high, 19, one_bits)
    if EXACT:
        w0 -= 1.0
        w1 -= 1.0
        w2 -= 1.0
        w3 -= 1.0
        w4 -= 1.0
        w5 -= 1.0
        w6 -= 1.0
        w7 -= 1.0
    base = (tl.arange(0, GROUPS)[:, None, None] * (PACKS * 8)
            + tl.arange(0, PACKS)[None, :, None] * 8 + tl.arange(0, 8)[None, None, :])
    in_k = base < K
    if NORM:
        norm_w = tl.load(norm_w_ptr + base, mask=in_k, other=0.0).to(tl.float32)
    rows = tl.arange(0, M_PAD)
    s = scales.to(tl.float32)
    y = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for m in tl.static_range(M_PAD):
        ok = in_k & (m < M)
        x = tl.load(x_ptr + m * stride_xm + base, mask=ok, other=0.0)
        if NORM:
            if HAS_RESIDUAL:
                r = tl.load(resid_ptr + m * stride_xm + base, mask=ok, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            rstd_m = tl.sum(tl.where(rows == m, rstd, 0.0), axis=0)
            x = ((x.to(tl.float32) * rstd_m).to(x.dtype).to(tl.float32) * norm_w).to(x.dtype)
        xf = x.to(tl.float32)
        # value r = 4a + 2b + c of each pack: split c, then b, then a
        c0, c1 = tl.split(tl.reshape(xf, [GROUPS, PACKS, 2, 2, 2]))
        c0b0, c0b1 = tl.split(c0)
        c1b0, c1b1 = tl.split(c1)
        x0, x4 = tl.split(c0b0)
        x2, x6 = tl.split(c0b1)
        x1, x5 = tl.split(c1b0)
        x3, x7 = tl.split(c1b1)
        # x / u: u = 2**-8 for values 0, 1, 4, 5, 2**-4 for 2, 3, 6, 7 (_inverse_units)
        t = (w0 * (x0 * 256.0)[None] + w1 * (x1 * 256.0)[None] + w2 * (x2 * 16.0)[None]
             + w3 * (x3 * 16.0)[None] + w4 * (x4 * 256.0)[None] + w5 * (x5 * 256.0)[None]
             + w6 * (x6 * 16.0)[None] + w7 * (x7 * 16.0)[None])
        main = tl.sum(tl.reshape(t * s[:, :, None], [BLOCK_N, GROUPS * PACKS]), axis=1)
        x_sum = tl.sum(tl.sum(xf, axis=2), axis=1)  # [GROUPS]
        offset = zeros.to(tl.float32) * x_sum[None, :]
        if not EXACT:
            x_u = ((x0 + x1 + x4 + x5) * 256.0 + (x2 + x3 + x6 + x7) * 16.0)
            offset += tl.sum(x_u, axis=1)[None, :]
        y_m = main - tl.sum(s * offset, axis=1)
        y += tl.where(rows[:, None] == m, y_m[None, :], 0.0)
    return y


@triton.jit
def _dequantized_tile(packed, zeros, scales, offs_k, one_bits):
    """packed int32 [BLOCK_N, BLOCK_K / 8] of one group, its zero points and scales [BLOCK_N]
    -> the weights (q - z) * s, float32 [BLOCK_N, BLOCK_K]: 1 + q u less 1, over u, is q
    exactly; q s - z s is one FMA of two exact products (4 + 11 significant bits each for
    fp16/bf16 scales), rounded once, as the reference's (q - z) * s."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    BLOCK_K: tl.constexpr = packed.shape[1] * 8
    inv_u = _inverse_units(offs_k)[None, :]
    w = tl.reshape(_unpack_offsets(packed, one_bits), [BLOCK_N, BLOCK_K])
    s = scales.to(tl.float32)
    return (w * inv_u - inv_u) * s[:, None] - (zeros.to(tl.float32) * s)[:, None]


# NOTE: M is the batch's token count; left to specialise (M == 1, M % 16 == 0) a prefill of a new
# length could compile the kernel again mid-serving. Its value only bounds masks
@triton.jit(do_not_specialize=["M"])
def _awq_gemm_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [N, K // 8] int32
    qzeros_ptr,  # [N, K // G] uint8
    scales_ptr,  # [N, K // G]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M,
    N,
    K,
    stride_wn,  # K // 8
    group_size,
    k_per_split,
    stride_xm,
    stride_om,
    stride_os,
    one_bits,  # ONE_BITS (see _offset_window)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides the group size, at least 16
    GROUP_M: tl.constexpr,  # row tiles launched together, sharing their weight tiles in L2
    PRECISION: tl.constexpr,  # tl.dot's input_precision ("ieee" for float32 inputs)
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    # programs in runs of GROUP_M row tiles down each column of tiles: consecutive programs
    # reuse one weight tile (dequantized again by each, but read from memory once)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    per_run = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = pid // per_run * GROUP_M
    run_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + pid % per_run % run_rows
    pid_n = pid % per_run // run_rows
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    n_groups = K // group_size
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + k_start + offs_k[None, :]
    qw_ptrs = (qweight_ptr + cols[:, None].to(tl.int64) * stride_wn + k_start // 8
               + tl.arange(0, BLOCK_K // 8)[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        packed = tl.load(qw_ptrs, mask=col_ok[:, None], other=0)
        group = cols * n_groups + k0 // group_size
        zeros = tl.load(qzeros_ptr + group, mask=col_ok, other=0)
        scales = tl.load(scales_ptr + group, mask=col_ok, other=0.0)
        w = _dequantized_tile(packed, zeros, scales, offs_k, one_bits)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K // 8
    out = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
           + cols[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _split_sum_kernel(
    partial_ptr,  # [num_splits, numel] float32
    out_ptr,  # [numel], contiguous
    numel,
    num_splits,
    SPLITS: tl.constexpr,  # num_splits rounded up to a power of two
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # NOTE: every split's partials load at once, one memory latency: a loop over the splits
    # waited one latency per split (16 splits took ~8 us of a 13 us o_proj GEMV on the H200).
    # tl.sum's order is fixed by the shapes, so the result is deterministic
    wait_for_inputs(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS)
    mask = (splits[:, None] < num_splits) & (offs[None, :] < numel)
    parts = tl.load(partial_ptr + splits[:, None].to(tl.int64) * numel + offs[None, :],
                    mask=mask, other=0.0)
    tl.store(out_ptr + offs, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty),
             mask=offs < numel)


@triton.jit
def _awq_dequantize_kernel(
    qweight_ptr,  # [N, K // 8] int32
    qzeros_ptr,  # [N, K // G] uint8
    scales_ptr,  # [N, K // G]
    out_ptr,  # [N, K]
    N,
    K,
    stride_wn,  # K // 8
    one_bits,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # a program: BLOCK_N rows of one group
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    row_ok = rows < N
    offs_k = tl.arange(0, GROUP)
    packed = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_wn + group * (GROUP // 8)
                     + tl.arange(0, GROUP // 8)[None, :], mask=row_ok[:, None], other=0)
    meta = rows * (K // GROUP) + group
    zeros = tl.load(qzeros_ptr + meta, mask=row_ok, other=0)
    scales = tl.load(scales_ptr + meta, mask=row_ok, other=0.0)
    w = _dequantized_tile(packed, zeros, scales, offs_k, one_bits)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + group * GROUP + offs_k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def check_awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     group_size: int) -> tuple[int, int]:
    """(N, K) of a valid AWQ weight in echo's layout."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    assert qweight.dtype == torch.int32 and qzeros.dtype == torch.uint8
    assert scales.is_floating_point()
    assert group_size % 8 == 0 and k % group_size == 0, \
        f"K={k} is not a multiple of G={group_size}, or G of 8"
    groups = k // group_size
    assert qzeros.shape == (n, groups), f"qzeros {tuple(qzeros.shape)} for [{n}, {groups}]"
    assert scales.shape == (n, groups), f"scales {tuple(scales.shape)} for [{n}, {groups}]"
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    return n, k


def _check(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           group_size: int) -> tuple[int, int, int]:
    """(M, K, N) of a valid call."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with a contiguous K"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    n, k = check_awq_weight(qweight, qzeros, scales, group_size)
    assert x.shape[1] == k, f"x {tuple(x.shape)} for K={k}"
    return x.shape[0], k, n


def gemv_block_n(n: int, k: int) -> int:
    """awq_gemv's default rows a program: a GEMV_SHARE_BYTES share, within N."""
    return max(1, min(GEMV_SHARE_BYTES * 2 // triton.next_power_of_2(k),
                      triton.next_power_of_2(n)))


def _block_k(group_size: int, want: int) -> int:
    """The largest power of two <= want that divides the group size."""
    return math.gcd(group_size, 1 << (want.bit_length() - 1))


def _num_splits(split_k: int | None, programs: int, k_tiles: int, per_sm: int,
                device: torch.device) -> tuple[int, int]:
    """(splits, K tiles per split), every split non-empty. By default: enough splits to give
    each SM `per_sm` programs."""
    if split_k is None:
        split_k = max(1, per_sm * sm_count(device, without_gpu=2) // programs)
    assert split_k >= 1
    tiles = triton.cdiv(k_tiles, min(split_k, k_tiles))
    return triton.cdiv(k_tiles, tiles), tiles


def _launch_split(launch, num_splits: int, m: int, n: int, out: torch.Tensor, pdl: dict) -> None:
    """Runs launch(target, stride between splits) straight into out, or into float32 partials
    that a second launch sums into out."""
    if num_splits == 1:
        launch(out, 0)
        return
    partial = torch.empty(num_splits, m, n, dtype=torch.float32, device=out.device)
    launch(partial, m * n)
    splits = triton.next_power_of_2(num_splits)
    block = max(32, _SUM_ELEMENTS // splits)
    _split_sum_kernel[(triton.cdiv(m * n, block),)](
        partial, out, m * n, num_splits, SPLITS=splits, BLOCK=block, **pdl, num_warps=4)


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_n: int | None = None,
             num_warps: int = 4, swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (M <= linear.MAX_ROWS) @ the AWQ weight [N, K]^T -> [M, N] in x's dtype: the
    one-row GEMV (linear.small_m_linear) with block_n weight rows a program over all of K
    (default gemv_block_n), loaded before the PDL wait; swiglu as small_m_linear's."""
    from echo_kernels.linear import small_m_linear

    n, k = check_awq_weight(qweight, qzeros, scales, group_size)
    return small_m_linear(x, qweight, qzeros, scales, group_size,
                          block_n=block_n or gemv_block_n(n, k), num_warps=num_warps,
                          swiglu=swiglu)


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
             group_m: int = 8, num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ the AWQ weight [N, K]^T -> [M, N] in x's dtype, on the tensor cores.

    Each weight tile is dequantized in float32 and rounded once to x's dtype before tl.dot
    (input_precision "ieee" for float32 x); fp32 accumulation. Tiles default to a config
    picked by M; block_k (at least 16) must divide group_size; split_k: K ranges (None: enough
    to fill the GPU; 1: one launch, no partial sums).
    """
    m, k, n = _check(x, qweight, qzeros, scales, group_size)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not m:
        return out
    tile_m, tile_n, tile_k, warps = _gemm_config(m)
    block_m = block_m or tile_m
    block_n = block_n or tile_n
    block_k = block_k or _block_k(group_size, tile_k)
    num_warps = num_warps or warps
    assert block_n >= 16 and block_m >= 16
    assert group_size % block_k == 0 and block_k >= 16 and block_k & (block_k - 1) == 0, \
        f"block_k={block_k} must be a power of two >= 16 dividing group_size={group_size}"
    programs = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    per_sm = _GEMM_DECODE_PROGRAMS_PER_SM if m <= _DECODE_ROWS else _GEMM_PROGRAMS_PER_SM
    num_splits, tiles = _num_splits(split_k, programs, k // block_k, per_sm, x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pdl = pdl_options(x.device)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_gemm_kernel[(programs, num_splits)](
            x, qweight, qzeros, scales, target, m, n, k, k // 8, group_size, tiles * block_k,
            x.stride(0), n, stride_split, ONE_BITS, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, GROUP_M=group_m, PRECISION=precision, **pdl,
            num_warps=num_warps, num_stages=num_stages)

    _launch_split(launch, num_splits, m, n, out, pdl)
    return out


def awq_dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The AWQ weight as a dense [N, K] in dtype: (q - z) * s in float32, rounded once."""
    n, k = check_awq_weight(qweight, qzeros, scales, group_size)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n = max(1, _DEQUANTIZE_WEIGHTS // group_size)
    _awq_dequantize_kernel[(triton.cdiv(n, block_n), k // group_size)](
        qweight, qzeros, scales, out, n, k, k // 8, ONE_BITS, GROUP=group_size,
        BLOCK_N=block_n, num_warps=4)
    return out


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ the AWQ weight [N, K]^T -> [M, N] in x's dtype: awq_gemv up to
    LINEAR_GEMV_ROWS rows, awq_gemm up to LINEAR_GEMM_ROWS, and from there the weight
    dequantized whole (awq_dequantize) and multiplied by cuBLAS. Groups under 16, which tl.dot
    cannot step through, skip awq_gemm."""
    if 1 <= x.shape[0] <= LINEAR_GEMV_ROWS:
        return awq_gemv(x, qweight, qzeros, scales, group_size)
    if x.shape[0] <= LINEAR_GEMM_ROWS and group_size >= 16:
        return awq_gemm(x, qweight, qzeros, scales, group_size)
    return torch.nn.functional.linear(x, awq_dequantize(qweight, qzeros, scales, group_size,
                                                        x.dtype))
