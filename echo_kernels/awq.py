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
[0, 4, 1, 5, 2, 6, 3, 7], i.e. at bit 4 * (r // 2) + 16 * (r % 2) (_nibble_shifts). An int32
whose top nibble is 8 or more is negative; every shift is masked with 0xF, so the sign does
not matter.

awq_gemv (1..GEMV_MAX_ROWS rows; awq_linear's for one row) dequantizes in registers in float32
and multiplies on the CUDA cores: each program owns BLOCK_N output columns (BLOCK_N / 8 int32
a weight row, each loaded once and shifted eight ways in one thread) over a K range, into an fp32
[M_PAD, 8, BLOCK_K, BLOCK_N / 8] accumulator reduced over K once at the end. awq_gemm (more
rows, prefill) dequantizes each [BLOCK_K, BLOCK_N] weight tile to x's dtype and feeds it to
tl.dot, fp32 accumulation. Nibbles become floats without a conversion instruction: ORed into
the mantissa of 2**23 (_as_float), and q - z is then a float32 subtraction.

The K-major layout makes a weight row of one program's columns only BLOCK_N / 2 bytes, so at a
few rows the output columns alone give too few programs to stream the weight at the memory's
bandwidth (N = 4096 in 64-column blocks is 64 programs). Both kernels therefore split K when
the grid would not fill the GPU: each split writes fp32 partial sums and a second launch adds
them in split order. No atomics: the output is deterministic for a given split.

Every K tile lies inside one group (G % BLOCK_K == 0), so a tile reads one row of scales and
zeros, and K needs no masks (K % G == 0).
"""

import math

import torch
import triton
import triton.language as tl

from echo_kernels.device import sm_count
from echo_kernels.pdl import pdl_options, wait_for_inputs

GEMV_MAX_ROWS = 16  # the most rows awq_gemv takes
# awq_linear's switch to the tensor-core kernel: from 2 rows on, awq_gemm's one 16-row tile
# with split-K beat the GEMV 3.7-4.9x at 16 rows and tied it at one (H200, Llama-3.1-8B's
# layers, docs/benchmarks.md AWQ, 2026-12-02)
LINEAR_GEMV_ROWS = 1
# programs to aim for per SM: a decode GEMV needs several in flight to cover memory latency, and
# so does the GEMM at decode rows (DECODE_ROWS); a larger GEMM splits only a grid under one
# wave (its partial sums cost M*N*4 bytes a split each way)
_GEMV_PROGRAMS_PER_SM = 4
_GEMM_PROGRAMS_PER_SM = 1
_GEMM_DECODE_PROGRAMS_PER_SM = 4  # the sweep's best splits gave 2-7 programs per SM
_DECODE_ROWS = 64
_GEMV_ACC_ELEMENTS = 4096  # M_PAD * BLOCK_K * BLOCK_N: the GEMV's accumulator
# (most rows, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)), first match wins; BLOCK_K is capped by
# the group size. The first and last from bench_kernels' sweep (2026-12-02: decode rows best at
# 16 x 128 x 64 for all four Llama-3.1-8B shapes; M = 4096 at 128 x 256 x 128 with 8 warps,
# 1.41-1.46x the earlier 128 x 128 x 64); the middle one untuned
_GEMM_CONFIGS = (
    (_DECODE_ROWS, (16, 128, 64, 4)),
    (512, (64, 128, 64, 4)),
    (None, (128, 256, 128, 8)),
)
_SUM_BLOCK = 1024


def _gemm_config(num_rows: int) -> tuple[int, int, int, int]:
    for most, config in _GEMM_CONFIGS:
        if most is None or num_rows <= most:
            return config
    raise AssertionError("unreachable")


@triton.jit
def _nibble_shifts():
    """[8] int32: the bit offset of output column 8j + r inside packed int32 j, for r = 0..7
    (4 * AWQ_REVERSE_ORDER[r])."""
    r = tl.arange(0, 8)
    return (r // 2) * 4 + (r % 2) * 16


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
def _packed_tile(qw_ptrs, packs, n_packed, k0, k_end, UNMASKED: tl.constexpr):
    if UNMASKED:
        return tl.load(qw_ptrs)
    return tl.load(qw_ptrs, mask=(packs[None, :] < n_packed) & (k0 < k_end), other=0)


@triton.jit
def _awq_gemv_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K, N // 8] int32
    qzeros_ptr,  # [K // G, N // 8] int32
    scales_ptr,  # [K // G, N]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M,
    N,
    K,
    n_packed,  # N // 8, the row stride of qweight and qzeros (an argument: its alignment
    # specialises, and the packed rows load as vectors)
    group_size,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_om,
    stride_os,  # between splits of out (0 when there is one)
    M_PAD: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # a multiple of 8
    BLOCK_K: tl.constexpr,  # divides the group size
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no masks on the weight
    PREFETCH: tl.constexpr,  # load the next packed tile before using this one
    USE_PDL: tl.constexpr,  # echo_kernels.pdl: the first weight tile loads before the wait
):
    PACKS: tl.constexpr = BLOCK_N // 8
    packs = tl.program_id(0) * PACKS + tl.arange(0, PACKS)
    cols = packs[None, :] * 8 + tl.arange(0, 8)[:, None]  # [8, PACKS]
    shifts = _nibble_shifts()
    split = tl.program_id(1)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    rows = tl.arange(0, M_PAD)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    qw_ptrs = qweight_ptr + offs_k[:, None].to(tl.int64) * n_packed + packs[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([M_PAD, 8, BLOCK_K, PACKS], dtype=tl.float32)
    # NOTE: as in linear.small_m_linear, these loads feed CUDA-core math, which Triton's
    # pipeliner does not stage: PREFETCH double-buffers the packed tiles in registers by hand
    if PREFETCH:
        # the weight is never written by a kernel: its first tile may load before the wait
        packed_next = _packed_tile(qw_ptrs, packs, n_packed, k_start, k_end, EVEN_N)
    wait_for_inputs(USE_PDL)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            packed = packed_next
            # past the split's last tile the mask is all false: no memory is read
            packed_next = _packed_tile(qw_ptrs + BLOCK_K * n_packed, packs, n_packed,
                                       k0 + BLOCK_K, k_end, False)
        else:
            packed = _packed_tile(qw_ptrs, packs, n_packed, k0, k_end, EVEN_N)
        w = _dequantize(packed, qzeros_ptr, scales_ptr, k0 // group_size, packs, cols, n_packed,
                        N, shifts)
        x = tl.load(x_ptrs, mask=rows[:, None] < M, other=0.0).to(tl.float32)
        acc += x[:, None, :, None] * w[None, :, :, :]
        qw_ptrs += BLOCK_K * n_packed
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)  # [M_PAD, 8, PACKS]
    out = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None, None] * stride_om
           + cols[None, :, :])
    tl.store(out, y.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None, None] < M) & (cols[None, :, :] < N))


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
    # programs in runs of GROUP_M row tiles down each column of tiles: consecutive programs
    # reuse one weight tile (dequantized again by each, but read from memory once)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    per_run = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = pid // per_run * GROUP_M
    run_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + pid % per_run % run_rows
    pid_n = pid % per_run // run_rows
    shifts = _nibble_shifts()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    packs = pid_n * PACKS + tl.arange(0, PACKS)
    cols = packs[None, :] * 8 + tl.arange(0, 8)[:, None]  # [8, PACKS]
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
        w = _dequantize(packed, qzeros_ptr, scales_ptr, k0 // group_size, packs, cols, n_packed,
                        N, shifts)
        # [8, BLOCK_K, PACKS] -> [BLOCK_K, PACKS, 8] -> [BLOCK_K, BLOCK_N], row-major: [k, j, r]
        # is column 8j + r
        w = tl.reshape(tl.permute(w.to(x_ptr.dtype.element_ty), (1, 2, 0)), (BLOCK_K, BLOCK_N))
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        qw_ptrs += BLOCK_K * n_packed
    out_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
           + out_cols[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (out_cols[None, :] < N))


@triton.jit
def _split_sum_kernel(
    partial_ptr,  # [num_splits, numel] float32
    out_ptr,  # [numel], contiguous
    numel,
    num_splits,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(num_splits):  # in split order: deterministic
        acc += tl.load(partial_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
           group_size: int) -> tuple[int, int, int]:
    """(M, K, N) of a valid call."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with a contiguous K"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32)
    m, k = x.shape
    n = qweight.shape[1] * 8
    assert qweight.dtype == qzeros.dtype == torch.int32
    assert scales.is_floating_point()
    assert group_size >= 1 and k % group_size == 0, f"K={k} is not a multiple of G={group_size}"
    groups = k // group_size
    assert qweight.shape == (k, n // 8), f"qweight {tuple(qweight.shape)} for K={k}"
    assert qzeros.shape == (groups, n // 8), f"qzeros {tuple(qzeros.shape)} for K/G={groups}"
    assert scales.shape == (groups, n), f"scales {tuple(scales.shape)} for [{groups}, {n}]"
    assert qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()
    return m, k, n


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
    _split_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](
        partial, out, m * n, num_splits, BLOCK=_SUM_BLOCK, **pdl, num_warps=4)


def awq_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_n: int | None = None,
             block_k: int | None = None, split_k: int | None = None, num_warps: int = 4,
             num_stages: int = 3, prefetch: bool = False) -> torch.Tensor:
    """x [M, K] (M <= GEMV_MAX_ROWS) @ AWQ weight [K, N] -> [M, N] in x's dtype.

    Weights dequantized in float32 (exactly), fp32 accumulation. block_n: output columns a
    program (a multiple of 8); block_k: K per step, a power of two dividing group_size; split_k:
    K ranges (None: enough to fill the GPU; 1: one launch, no partial sums).
    """
    m, k, n = _check(x, qweight, qzeros, scales, group_size)
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"awq_gemv takes 1..{GEMV_MAX_ROWS} rows, got {m}")
    m_pad = triton.next_power_of_2(m)
    # NOTE: untuned. 64 columns are 32 bytes of a packed weight row, one memory sector; the
    # accumulator holds M_PAD * BLOCK_K * BLOCK_N floats, so K per step shrinks as M grows
    block_n = block_n or 64
    block_k = block_k or _block_k(group_size, max(8, _GEMV_ACC_ELEMENTS // (m_pad * block_n)))
    assert block_n % 8 == 0 and block_n & (block_n - 1) == 0, "block_n: a power of two >= 8"
    assert group_size % block_k == 0 and block_k & (block_k - 1) == 0, \
        f"block_k={block_k} must be a power of two dividing group_size={group_size}"
    programs = triton.cdiv(n, block_n)
    num_splits, tiles = _num_splits(split_k, programs, k // block_k, _GEMV_PROGRAMS_PER_SM,
                                    x.device)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = pdl_options(x.device)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_gemv_kernel[(programs, num_splits)](
            x, qweight, qzeros, scales, target, m, n, k, n // 8, group_size, tiles * block_k,
            x.stride(0), n, stride_split, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k,
            EVEN_N=n % block_n == 0, PREFETCH=prefetch, **pdl, num_warps=num_warps,
            num_stages=num_stages)

    _launch_split(launch, num_splits, m, n, out, pdl)
    return out


def awq_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
             scales: torch.Tensor, group_size: int, *, block_m: int | None = None,
             block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
             group_m: int = 8, num_warps: int | None = None,
             num_stages: int = 3) -> torch.Tensor:
    """x [M, K] @ AWQ weight [K, N] -> [M, N] in x's dtype, on the tensor cores.

    Each weight tile is dequantized in float32 and rounded once to x's dtype before tl.dot
    (input_precision "ieee" for float32 x); fp32 accumulation. Tiles default to a config picked
    by M; block_k (at least 16) must divide group_size; split_k as in awq_gemv.
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
            GROUP_M=group_m, PRECISION=precision, **pdl, num_warps=num_warps,
            num_stages=num_stages)

    _launch_split(launch, num_splits, m, n, out, pdl)
    return out


def awq_linear(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ the AWQ weight [K, N] -> [M, N] in x's dtype: awq_gemv up to
    LINEAR_GEMV_ROWS rows (GEMV_MAX_ROWS under a group of 16, which tl.dot cannot step
    through), awq_gemm beyond (and for M = 0)."""
    rows = LINEAR_GEMV_ROWS if group_size >= 16 else GEMV_MAX_ROWS
    if 1 <= x.shape[0] <= rows:
        return awq_gemv(x, qweight, qzeros, scales, group_size)
    return awq_gemm(x, qweight, qzeros, scales, group_size)
