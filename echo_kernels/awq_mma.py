"""AWQ W4A16 for decode rows on the tensor cores: the weight repacked into mma_v2's operand
registers, written in Gluon (Triton's explicit-layout dialect). CUDA only: Gluon has no
interpreter, so the CPU keeps AutoAWQ's layout and awq.py's kernels.

Why: awq_gemv, on the CUDA cores, runs ~3.4 SASS instructions a weight and a Llama-3.1-8B step
needs its GEMVs near the copy bandwidth. Marlin's way puts the weight into the tensor core's
m16n8k16 as operand A straight from registers; tl.dot cannot take A from registers in a layout
of our choosing, Gluon's DotOperandLayout and mma_v2 can. x is operand B, whose 8 columns are 8
rows of x; more rows take more programs (8, 16 or 32 a program).

The repacked qweight (repack_awq, at load): int32 [N / 16, K / 64, 32, 4]. Word [nt, kc, lane,
j] holds one lane's eight A values of a 16 x 16 tile: output column n = 16 nt + 8 n3 + lane // 4
and, within group g of G inputs, k = G g + (G / 4) (lane % 4) + 4 s + 2 h + k0 (s = 4 (kc mod
G / 64) + j, the tile's 16-wide K step), at nibble n3 + 2 h + 4 k0. mma_v2's A layout gives a
lane the register pairs (k0 = 0, 1) of one column, four pairs (n3, h) a tile, so a pair is one
shift and one LOP3 into the mantissa of 1.0 (w' = 1 + q u, u = 2**-7 in bf16, 2**-10 in fp16),
and a lane's four tiles of a 64-wide chunk are one 16-byte load. K is permuted within a group
(the tensor cores sum over any order of K that A and B share) so that a lane's x of a group is
contiguous too: (G / 4) (lane % 4) + 4 s + 2 h + k0 holds its K of every step. qzeros and scales
keep AutoAWQ's layout (awq.py).

Per group the tensor cores give A = sum_k w'_k x_k and, with a tile of ones, S = sum_k x_k;
sum_k (q_k - z) x_k = A / u - (1 / u + z) S, times the scale, is folded into a float32 total
(awq_gemv's algebra, with the products exact in the tensor core's float32). Splits of K add
their partial sums in awq.py's split-sum launch (SwiGLU there too), or, given a layer's
arrival counts, inside the GEMV's launch: each split stores its partials and counts its
arrival (acq_rel), and the last of a column block adds them.

A program's next group of weights (or next two: `ahead`), x, scales and zeros wait in
registers while the current one is summed (a ring of groups in shared memory filled by cp.async
was 35-60% slower: docs/benchmarks.md, AWQ). At one row x comes instead from shared memory,
where the program puts its split's x with one load after the PDL wait: held in registers, x
took 16 of the loop's 64 (mma_v2's B operand over 8 rows, one of them real), and under that
cap ptxas issued the next group's loads after the group's HMMAs, so that every group waited
for a memory latency (offline sm_90 SASS); with x in shared memory they issue early in the loop.

Under PDL a program loads its first group's weights, scales and zeros, then waits for the
previous kernel, and lets the next kernel launch only after its loop. Letting it launch at the
wait, as echo's Triton kernels do, made a Llama-3.1-8B AWQ step 3.235 ms against 2.639 (an
H100; 2.946 without PDL); the likely cause, not profiled: the next kernel's waiting programs
hold registers that this kernel's programs past the first wave need (8 an SM at 64 registers
fill the register file).

Rows past MMA_MAX_ROWS, up to GEMM_MAX_ROWS, take awq_gemm_repacked (Triton): awq_gemm's tiles
over this layout, each weight tile dequantized in registers for tl.dot. Past that the weight is
dequantized whole (awq_dequantize_repacked) and the product left to cuBLAS. Both Triton kernels
run in the CPU tests. Figures: docs/benchmarks.md, AWQ.
"""

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from echo_kernels.activation import silu_and_mul
from echo_kernels.awq import (
    _GEMM_PROGRAMS_PER_SM,
    _launch_split,
    _num_splits,
    gemm_tile,
    nibble_shift,
)
from echo_kernels.pdl import pdl_options, wait_for_inputs
from echo_kernels.reference import awq_unpack_ref

CHUNK = 64  # K of a lane's 16-byte load: four 16-wide mma steps
OUTPUT_BLOCK = 128  # output columns must fill the largest program (4 warps x 2 tiles x 16)
# the most rows through the tensor-core GEMV: at 64 rows a Llama-3.1-8B layer took 229.4 us
# against 209.7 for awq_gemm's tiles and ~272 for the dense weight and cuBLAS; at 32, 137.7
# against 192.4 (one H100, tools/dev/probe_awq_mma_gemv.py, docs/benchmarks.md AWQ)
MMA_MAX_ROWS = 64
# the most rows through awq_gemm_repacked, past them the dense weight and cuBLAS: awq_gemm's
# tile (128 x 256, a group along K) took a layer's four GEMMs in 246.4 us at 128 rows against
# 328.1 for the dense weight, 443.7 against 331.3 at 256 (one H200, 2026-12-04)
GEMM_MAX_ROWS = 128
_GEMM_TILE = (128, 16, 8)  # rows, 16-column tiles, warps a program
_MAGIC = {torch.bfloat16: 0x3F803F80, torch.float16: 0x3C003C00}  # 1.0 in both halves
# (warps, 16-column tiles a warp, programs an SM the splits aim at, groups of weights in flight
# ahead): one row wanted one tile a warp and ~8 programs an SM (gate_up 25.8 us, down 15.0, qkv
# 9.5), more rows two tiles and 4. With x in shared memory one group ahead beat two at every
# Llama-3.1-8B layer in the start-up tuning's timings (H100, 2026-12-07: gate_up + SwiGLU 24.6
# against 26.3 us, down 13.7 against 14.9; qkv and o_proj 7.7 and 6.0 at 4 an SM against 8.9
# and 7.4 for two ahead at 8)
_ONE_ROW = (4, 1, 8, 1)
_ROWS = (4, 2, 4, 1)
_DEQUANTIZE_WARPS = 4
# the most groups of a split whose x (one row) goes through shared memory: 8 KB a program at
# 128 a group, so that 8 programs an SM keep their shared memory under a third of it
X_SHARED_GROUPS = 32


def repack_awq(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """AutoAWQ qweight int32 [K, N / 8] -> int32 [N / 16, K / 64, 32, 4] (module docstring),
    a group at a time (the unpacked nibbles of a whole layer would take 8 bytes a weight)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if group_size % CHUNK or k % group_size or n % 16:
        raise ValueError(f"AWQ on the tensor cores needs a group size divisible by {CHUNK} and "
                         f"output features divisible by 16, got group_size {group_size}, "
                         f"[{k}, {n}]")
    steps = group_size // 16
    shifts = _repack_shifts(qweight.device)
    out = torch.empty(n // 16, k // CHUNK, 32, 4, dtype=torch.int32, device=qweight.device)
    per_group = group_size // CHUNK
    for g in range(k // group_size):
        q = awq_unpack_ref(qweight[g * group_size:(g + 1) * group_size])  # [G, N] int64
        # k = (G / 4) t + 4 s + 2 h + k0, n = 16 nt + 8 n3 + lane // 4: [t, s, h, k0, nt, n3, l]
        q = q.view(4, steps, 2, 2, n // 16, 2, 8)
        words = (q << shifts).sum(dim=(2, 3, 5))  # [t, s, nt, l]
        words = words.view(4, steps // 4, 4, n // 16, 8).permute(3, 1, 4, 0, 2)  # nt sc l t j
        words = words.reshape(n // 16, per_group, 32, 4)
        out[:, g * per_group:(g + 1) * per_group] = (words - (words >= 2**31) * 2**32).int()
    return out


def _repack_shifts(device: torch.device) -> torch.Tensor:
    """The nibble offset of each (h, k0, n3) in a repacked word, shaped for repack_awq's
    [t, s, h, k0, nt, n3, l] view."""
    h = torch.arange(2, device=device).view(1, 1, 2, 1, 1, 1, 1)
    k0 = torch.arange(2, device=device).view(1, 1, 1, 2, 1, 1, 1)
    n3 = torch.arange(2, device=device).view(1, 1, 1, 1, 1, 2, 1)
    return 4 * (n3 + 2 * h + 4 * k0)


@triton.jit
def _repacked_weights(rq_ptr, qzeros_ptr, scales_ptr, nt0, g, N, K, TILES: tl.constexpr,
                      GROUP: tl.constexpr):
    """(q - z) * s float32 [16 TILES, GROUP] of the columns from 16 nt0 and group g, K in the
    repacked order (_repacked_k) rather than the natural one: the words are loaded so that the
    nibbles land in place by broadcasting alone, with no reordering in registers."""
    C: tl.constexpr = GROUP // 64
    # word [nt, kc, lane, j] sits at (nt K / 64 + kc) 128 + 4 lane + j, lane = 4 l + t; loaded
    # as [tile, l, chunk, t, j], its nibble n3 + 2 h + 4 k0 broadcast to [tile, n3, l, chunk,
    # t, j, h, k0]: rows (tile, n3, l) are columns 16 tile + 8 n3 + l, in order
    tile = _at(TILES, 0, 5)
    words = tl.load(rq_ptr + ((nt0 + tile).to(tl.int64) * (K // 64) + g * C + _at(C, 2, 5)) * 128
                    + 16 * _at(8, 1, 5) + 4 * _at(4, 3, 5) + _at(4, 4, 5))
    shift = 4 * (_at(2, 1, 8) + 2 * _at(2, 6, 8) + 4 * _at(2, 7, 8))  # [1, n3, 1 ... 1, h, k0]
    q = (tl.expand_dims(tl.expand_dims(tl.expand_dims(words, 1), 6), 7) >> shift) & 0xF
    q = tl.reshape(q, (16 * TILES, GROUP))
    n = nt0 * 16 + tl.arange(0, 16 * TILES)
    z = (tl.load(qzeros_ptr + g * (N // 8) + n // 8) >> nibble_shift(n)) & 0xF
    s = tl.load(scales_ptr + g * N + n).to(tl.float32)
    return (q - z[:, None]).to(tl.float32) * s[:, None]


@triton.jit
def _at(n: tl.constexpr, axis: tl.constexpr, rank: tl.constexpr):
    """arange(n) along `axis` of a rank-`rank` tensor (size 1 elsewhere)."""
    i = tl.arange(0, n)
    for d in tl.static_range(rank):
        if d < axis:
            i = tl.expand_dims(i, 0)
        elif d > axis:
            i = tl.expand_dims(i, d)
    return i


@triton.jit
def _repacked_k(GROUP: tl.constexpr):
    """[GROUP]: the input k (within its group) of each position of _repacked_weights' K axis,
    (chunk, t, j, h, k0) row-major: k = (G / 4) t + 16 chunk + 4 j + 2 h + k0."""
    kk = tl.arange(0, GROUP)
    return (GROUP // 4) * ((kk // 16) % 4) + 16 * (kk // 64) + kk % 16


@triton.jit
def _dequantize_repacked_kernel(
    rq_ptr,  # [N / 16, K / 64, 32, 4] int32
    qzeros_ptr,  # [K // G, N // 8] int32, AutoAWQ's
    scales_ptr,  # [K // G, N]
    out_ptr,  # [N, K] in x's dtype
    N,
    K,
    GROUP: tl.constexpr,
):
    # one program: 16 columns by one group; 16 consecutive k of a row in each run of its K
    nt = tl.program_id(0)
    g = tl.program_id(1)
    w = _repacked_weights(rq_ptr, qzeros_ptr, scales_ptr, nt, g, N, K, 1, GROUP)
    n = nt * 16 + tl.arange(0, 16)
    k = g * GROUP + _repacked_k(GROUP)
    tl.store(out_ptr + n[:, None].to(tl.int64) * K + k[None, :], w.to(out_ptr.dtype.element_ty))


# NOTE: M left unspecialised, as in awq._awq_gemm_kernel: a new batch size must not compile again
@triton.jit(do_not_specialize=["M"])
def _awq_gemm_repacked_kernel(
    x_ptr,  # [M, K]
    rq_ptr,  # [N / 16, K / 64, 32, 4] int32
    qzeros_ptr,  # [K // G, N // 8] int32, AutoAWQ's
    scales_ptr,  # [K // G, N]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M, N, K, stride_xm, stride_om, stride_os, groups_per_split,
    BLOCK_M: tl.constexpr,
    TILES: tl.constexpr,  # 16-column tiles a program
    GROUP: tl.constexpr,
    GROUP_M: tl.constexpr,  # row tiles launched together, sharing their weight tiles in L2
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    BLOCK_N: tl.constexpr = 16 * TILES
    pid_m, pid_n = gemm_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    split = tl.program_id(1)
    first = split * groups_per_split
    end = tl.minimum(first + groups_per_split, K // GROUP)
    # x's K in the weight tile's order (_repacked_k): runs of 16 consecutive inputs
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + _repacked_k(GROUP)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(first, end):
        x = tl.load(x_ptrs + g * GROUP, mask=row_ok[:, None], other=0.0)
        w = _repacked_weights(rq_ptr, qzeros_ptr, scales_ptr, pid_n * TILES, g, N, K, TILES,
                              GROUP)
        acc = tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)), acc)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = (out_ptr + split.to(tl.int64) * stride_os + rows[:, None].to(tl.int64) * stride_om
           + cols[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def awq_dequantize_repacked(rq: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                            group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The repacked AWQ weight as a dense W^T [N, K] in dtype: (q - z) * s in float32, rounded
    once (awq_dequantize's values, transposed)."""
    n, k = rq.shape[0] * 16, rq.shape[1] * CHUNK
    out = torch.empty(n, k, dtype=dtype, device=rq.device)
    _dequantize_repacked_kernel[(n // 16, k // group_size)](
        rq, qzeros, scales, out, n, k, GROUP=group_size, num_warps=_DEQUANTIZE_WARPS)
    return out


@gluon.jit
def _halves(v, BF16: gl.constexpr):
    """int32 [...] -> [..., 2] of its two halves, low first: the register as it is (the asm
    takes it twice, pack=2, and returns it as two halves)."""
    if BF16:
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(v, v)],
                                         dtype=gl.bfloat16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(v, v)],
                                         dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _weight_pair(words, magic, SHIFT: gl.constexpr, BF16: gl.constexpr):
    """[..., 2]: the weights 1 + q u at nibbles SHIFT / 4 and SHIFT / 4 + 4 (k0 = 0, 1), ORed
    into the mantissa of 1.0 in both halves (magic comes in a register, so that the mask and
    the OR are one LOP3: an instruction holds one immediate)."""
    return _halves(((words >> SHIFT) & 0x000F000F) | magic, BF16)


@gluon.constexpr_function
def _along(layout, dim):
    """The 1-D layout of dim of a 5-D layout."""
    for d in range(4, -1, -1):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@gluon.jit
def _index(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dim of a 5-D layout, expanded to 5-D."""
    i = gl.arange(0, n, layout=_along(layout, dim))
    for d in gl.static_range(5):
        if d != dim:
            i = gl.expand_dims(i, d)
    return i


@gluon.constexpr_function
def _words_layout(tiles, warps, steps):
    """A program's repacked words of one group, [tile // WARPS, warp, lane // 4, step, lane %
    4]: a lane's steps (four of them a 16-byte load), then its tiles, in registers; tile = warp
    + WARPS * (tile // WARPS), as mma_v2's A layout spreads 16-row tiles over warps."""
    return gl.BlockedLayout(size_per_thread=[tiles, 1, 1, steps, 1],
                            threads_per_warp=[1, 1, 8, 1, 4], warps_per_cta=[1, warps, 1, 1, 1],
                            order=[4, 2, 3, 0, 1])


@gluon.jit
def _words_offsets(pid_n, K, TILES: gl.constexpr, WARPS: gl.constexpr, STEPS: gl.constexpr,
                   layout: gl.constexpr):
    """The int32 offsets of column block pid_n's words of group 0 in _words_layout (group g's
    are GROUP * 2 further)."""
    tile = (pid_n * (TILES * WARPS) + _index(TILES, 0, layout) * WARPS
            + _index(WARPS, 1, layout))
    step = _index(STEPS, 3, layout)
    return (tile.to(gl.int64) * (K // 64 * 128) + _index(8, 2, layout) * 16
            + (step // 4) * 128 + step % 4 + _index(4, 4, layout) * 4)


@gluon.constexpr_function
def _x_layout(rows, group, warps):
    """x [rows, 4, group / 8] as int32 pairs: a lane's group / 8 words, then rows 8 apart, in
    its registers; rows mod 8 and the quarter (lane % 4) over lanes, where mma_v2's B layout
    puts N and K; every warp holds all of it."""
    def bits(n):
        return [1 << i for i in range(n.bit_length() - 1)]

    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, b] for b in bits(group // 8)] + [[8 * b, 0, 0] for b in bits(rows // 8)],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0] for _ in bits(warps)], block_bases=[], shape=[rows, 4, group // 8])


@gluon.constexpr_function
def _sum_rows(splits, bm):
    """Rows _sum_splits adds at a time: up to 1,024 partials, 8 a thread at 4 warps (the
    one-row loop needs 64 registers)."""
    return max(1, min(8, 1024 // (splits * bm)))


@gluon.constexpr_function
def _sum_layout(splits, bm, warps):
    """[splits, rows, bm] over the threads without copies across warps: a warp's lanes over
    min(32, bm / warps) columns and the rest of its lanes over the splits (their sum then
    partly a shuffle)."""
    columns = min(32, max(1, bm // warps))
    lanes = 32 // columns
    return gl.BlockedLayout([max(1, splits // lanes), 1, 1], [lanes, 1, columns],
                            [1, 1, warps], [2, 0, 1])


@gluon.jit
def _sum_splits(partial_ptr, out_ptr, row0, rows, col0, N, stride_os, num_splits,
                SPLITS: gl.constexpr, BM: gl.constexpr, WARPS: gl.constexpr,
                SWIGLU: gl.constexpr):
    """out[row0 + r, col0 + c] = the sum over splits of the partials [num_splits, M, N]
    (r < rows, c < BM), in an order fixed by the shapes; SWIGLU: silu(gate) * up, gate at
    column col0 + c and up N / 2 further, out [M, N / 2], gate and up rounded to out's dtype
    first as awq.py's split sum does. A few rows at a time, every split's partials of them
    loaded at once (one memory latency)."""
    R: gl.constexpr = _sum_rows(SPLITS, BM)
    layout: gl.constexpr = _sum_layout(SPLITS, BM, WARPS)
    out_layout: gl.constexpr = gl.SliceLayout(0, layout)  # [R, BM] after the sum
    r = gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(1, out_layout)), 1)
    c = gl.expand_dims(gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout)), 0)
    s = gl.expand_dims(gl.expand_dims(
        gl.arange(0, SPLITS, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout))), 1), 2)
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    width = N // 2 if SWIGLU else N
    for r0 in range(0, rows, R):
        row_ok = r0 + r < rows
        ok = (s < num_splits) & gl.expand_dims(row_ok, 0)
        src = (partial_ptr + s.to(gl.int64) * stride_os
               + gl.expand_dims((row0 + r0 + r) * N + col0 + c, 0))
        total = gl.sum(gl.load(src, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        if SWIGLU:
            up = gl.sum(gl.load(src + N // 2, mask=ok, other=0.0, cache_modifier=".cg"),
                        axis=0).to(dtype).to(gl.float32)
            gate = total.to(dtype).to(gl.float32)
            # activation.silu_times (a triton.jit Gluon cannot call)
            act = (gate / (1.0 + gl.exp2(-gate * 1.4426950408889634))).to(dtype)
            total = act.to(gl.float32) * up
        gl.store(out_ptr + (row0 + r0 + r) * width + col0 + c, total.to(dtype), mask=row_ok)


@gluon.jit(do_not_specialize=["M", "groups_per_split", "num_splits"])
def _awq_mma_kernel(
    x_ptr,  # [M, K] as int32 pairs of halves
    rq_ptr,  # [N / 16, K / 64, 32, 4] int32
    qzeros_ptr,  # [K // G, N // 8] int32, AutoAWQ's
    scales_ptr,  # [K // G, N]
    out_ptr,  # [M, N] in x's dtype, or [num_splits, M, N] float32 partial sums
    M, N, K, n_packed, stride_xm, stride_om, stride_os, groups_per_split,
    magic,  # 1.0 in both halves of an int32 (_MAGIC)
    arrivals_ptr,  # SUM_SPLITS: int32 arrival counts, zero, and zero again when it returns
    sum_ptr,  # SUM_SPLITS: [M, N] (or [M, N / 2] with SWIGLU) in x's dtype
    num_splits,
    GROUP: gl.constexpr,  # a multiple of 64
    WARPS: gl.constexpr,
    TILES: gl.constexpr,  # 16-column tiles a warp
    ROWS: gl.constexpr,  # rows of x a program: 8, 16 or 32 (mma_v2's N)
    BF16: gl.constexpr,
    USE_PDL: gl.constexpr,
    AHEAD: gl.constexpr,  # groups of weights in flight beyond the one being summed: 1 or 2
    # (2: a split's first two groups loaded before the PDL wait)
    X_SPLIT: gl.constexpr,  # 0, or (one row) the split's groups rounded up to a power of two:
    # its x loaded once into shared memory, read from there a group at a time
    SUM_SPLITS: gl.constexpr,  # 0, or num_splits rounded up to a power of two: the last
    # split of a column block to finish adds the partial sums (no split-sum launch)
    SWIGLU: gl.constexpr,  # with SUM_SPLITS: store silu(gate) * up of the product's halves
):
    BM: gl.constexpr = 16 * WARPS * TILES
    STEPS: gl.constexpr = GROUP // 16
    INV_U: gl.constexpr = 128.0 if BF16 else 1024.0
    DTYPE: gl.constexpr = gl.bfloat16 if BF16 else gl.float16
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, 8])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    w_layout: gl.constexpr = _words_layout(TILES, WARPS, STEPS)
    # NOTE: x is read as int32 pairs: a loop-carried 16-bit tensor took 16-bit registers, which
    # ptxas packed, permuted and spilled
    x_layout: gl.constexpr = _x_layout(ROWS, GROUP, WARPS)
    pid_n = gl.program_id(0)
    split = gl.program_id(1)
    row0 = gl.program_id(2) * ROWS
    rows = M - row0
    w_offs = _words_offsets(pid_n, K, TILES, WARPS, STEPS, w_layout)
    xm = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_layout)))
    xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_layout)))
    xr = gl.arange(0, GROUP // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_layout)))
    xm = gl.expand_dims(gl.expand_dims(xm, 1), 2)
    x_offs = (xm * (stride_xm // 2) + gl.expand_dims(gl.expand_dims(xt, 0), 2) * (GROUP // 8)
              + gl.expand_dims(gl.expand_dims(xr, 0), 1))
    x_mask = xm < rows
    x_ptr += row0 * (stride_xm // 2)
    # S by the tensor cores, its rows all equal. At one row in the product's shape, so that a
    # lane holds S where it holds its products (no max across lanes; ptxas computes a warp's
    # equal tiles once): with x's row copied rather than zeroed below, the one-row loop went
    # from 178 to 153 instructions a group, and the GEMV 4-9% faster at Llama-3.1-8B's layers
    # (one H100, docs/benchmarks.md AWQ, 2026-12-07 night); at more rows, not yet timed so, 16
    # rows reduced to one
    S_ROWS: gl.constexpr = BM if X_SPLIT > 0 else 16
    ones = gl.full([S_ROWS, GROUP], 1.0, DTYPE, a_layout)
    cn = pid_n * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
    cm = gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
    r = cn % 8
    z_shift = (r // 2) * 4 + (r % 2) * 16  # awq.nibble_shift (a triton.jit Gluon cannot call)
    first = split * groups_per_split
    end = gl.minimum(first + groups_per_split, K // GROUP)
    total = gl.zeros([BM, ROWS], gl.float32, mma)
    # before the PDL wait: the first group's weights, scales and zeros (and the second's weights)
    words = gl.load(rq_ptr + w_offs + first * (GROUP * 2))
    if AHEAD == 2:
        words_next = gl.load(rq_ptr + w_offs + gl.minimum(first + 1, end - 1) * (GROUP * 2))
    s = gl.load(scales_ptr + first * N + cn)
    zq = gl.load(qzeros_ptr + first * n_packed + cn // 8)
    if USE_PDL:  # pdl.wait_for_inputs' wait (a triton.jit Gluon cannot call)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
    if X_SPLIT > 0:
        # one load of the split's x, so that the loop's loads are the weights, scales and zeros
        # alone, and x holds registers only while its group is summed
        x_line: gl.constexpr = gl.BlockedLayout([max(1, X_SPLIT * GROUP // 2 // (32 * WARPS))],
                                                [32], [WARPS], [0])
        xi = gl.arange(0, X_SPLIT * (GROUP // 2), layout=x_line)
        xv = gl.load(x_ptr + first * (GROUP // 2) + xi, mask=xi < (end - first) * (GROUP // 2),
                     other=0)
        x_smem = gl.allocate_shared_memory(
            gl.int32, [X_SPLIT, 4, GROUP // 8],
            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]),
            gl.reshape(xv, [X_SPLIT, 4, GROUP // 8]))
        # the same unswizzled bytes as groups of [4, GROUP / 8] (index wants a layout of the
        # sub-view's rank)
        x_smem = x_smem._reinterpret(
            gl.int32, [X_SPLIT, 4, GROUP // 8],
            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        gl.thread_barrier()
    else:
        xb = gl.load(x_ptr + x_offs + first * (GROUP // 2), mask=x_mask, other=0)
    for group in range(first, end):
        # the next group's (or next two groups') weights, and its x, scales and zeros, in
        # flight while this one is summed
        nxt = gl.minimum(group + 1, end - 1)
        if AHEAD == 2:
            ahead = gl.minimum(group + 2, end - 1)
            words_after = gl.load(rq_ptr + w_offs + ahead * (GROUP * 2))
        else:
            words_next = gl.load(rq_ptr + w_offs + nxt * (GROUP * 2))
        if X_SPLIT > 0:  # row 0 from shared memory, copied into the mma's other rows: their
            # columns of the product are never stored, so they need not be zero
            x_row = x_smem.index(group - first).load(gl.SliceLayout(0, x_layout))
            xb = gl.expand_dims(x_row, 0).broadcast_to([ROWS, 4, GROUP // 8])
        else:
            xb_next = gl.load(x_ptr + x_offs + nxt * (GROUP // 2), mask=x_mask, other=0)
        s_next = gl.load(scales_ptr + nxt * N + cn)
        zq_next = gl.load(qzeros_ptr + nxt * n_packed + cn // 8)
        # pairs (n3, h) = (0, 0), (1, 0), (0, 1), (1, 1) at nibbles 0-3 (k0 = 0) and 4-7
        a = gl.join(gl.join(_weight_pair(words, magic, 0, BF16),
                            _weight_pair(words, magic, 4, BF16)),
                    gl.join(_weight_pair(words, magic, 8, BF16),
                            _weight_pair(words, magic, 12, BF16)))
        # [tile // WARPS, warp, l, step, t, k0, n3, h] -> rows (tile, n3, l), K (step, h, t, k0)
        a = gl.permute(a, (0, 1, 6, 2, 3, 7, 4, 5))
        a = gl.convert_layout(gl.reshape(a, [BM, GROUP]), a_layout, assert_trivial=True)
        # [row, t, step, h, k0] -> K (step, h, t, k0) by row: mma_v2's B layout, no movement
        b = gl.permute(gl.reshape(_halves(xb, BF16), [ROWS, 4, STEPS, 2, 2]), (2, 3, 1, 4, 0))
        b = gl.convert_layout(gl.reshape(b, [GROUP, ROWS]), b_layout, assert_trivial=True)
        acc = mma_v2(a, b, gl.zeros([BM, ROWS], gl.float32, mma))
        x_sum = mma_v2(ones, b, gl.zeros([S_ROWS, ROWS], gl.float32, mma))
        if X_SPLIT == 0:
            x_sum = gl.expand_dims(gl.max(x_sum, axis=0), 0)
        z = ((zq >> z_shift) & 0xF).to(gl.float32)
        total += gl.expand_dims(s.to(gl.float32), 1) * (
            acc * INV_U - gl.expand_dims(INV_U + z, 1) * x_sum)
        words = words_next
        s = s_next
        zq = zq_next
        if AHEAD == 2:
            words_next = words_after
        if X_SPLIT == 0:
            xb = xb_next
    if USE_PDL:  # the next kernel launches now, not at the wait (module docstring)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
    out = (out_ptr + split.to(gl.int64) * stride_os + (row0 + gl.expand_dims(cm, 0)) * stride_om
           + gl.expand_dims(cn, 1))
    gl.store(out, total.to(out_ptr.dtype.element_ty),
             mask=(gl.expand_dims(cm, 0) < rows) & (gl.expand_dims(cn, 1) < N))
    if SUM_SPLITS > 0:
        # column blocks b and b + blocks / 2 hold SwiGLU's gate and up of the same outputs:
        # they count as one
        blocks = gl.num_programs(0) // 2 if SWIGLU else gl.num_programs(0)
        counter = arrivals_ptr + gl.program_id(2) * blocks + pid_n % blocks
        gl.thread_barrier()  # every thread's stores before the arrival (the atomic releases them)
        arrived = gl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == (2 * num_splits if SWIGLU else num_splits) - 1:
            gl.store(counter, 0)  # for the next launch: nobody else counts here in this one
            _sum_splits(out_ptr, sum_ptr, row0, gl.minimum(rows, ROWS), (pid_n % blocks) * BM,
                        N, stride_os, num_splits, SUM_SPLITS, BM, WARPS, SWIGLU)


def max_registers(sum_inside: bool, rows: int, tiles: int, ahead: int = 1) -> int | None:
    """maxnreg for awq_mma_gemv: with the sum inside, the 64 registers of the loop over one
    tile a warp at 8 rows and one group ahead, at which 8 programs of 4 warps fit an SM (the
    sum would take 72-80, offline sm_90, and leave one of eight out of the first wave); else
    ptxas's choice. Two groups ahead (offline sm_90, the sum inside): x in registers 80
    registers, x in shared memory 64 left to ptxas, 24 bytes of spills under the cap."""
    return 64 if sum_inside and rows == 8 and tiles == 1 and ahead == 1 else None


def arrival_counts(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed arrival counts for awq_mma_gemv of an N-column weight at any setting and up to
    MMA_MAX_ROWS rows: a layer holds one (a count per column block and row block)."""
    return torch.zeros(n // 16 * triton.cdiv(MMA_MAX_ROWS, 8), dtype=torch.int32, device=device)


def awq_mma_gemv(x: torch.Tensor, rq: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int, arrivals: torch.Tensor | None = None, *,
                 warps: int | None = None, tiles: int | None = None, per_sm: int | None = None,
                 rows: int | None = None, split_k: int | None = None,
                 ahead: int | None = None, x_shared: bool | None = None,
                 swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (fp16/bf16, CUDA) @ the repacked AWQ weight [K, N] -> [M, N] in x's dtype;
    swiglu: silu(gate) * up of the product's halves, [M, N / 2]. A program takes `rows` rows
    (8, 16 or 32; each reads its weights again, from the L2 when they run together) and WARPS x
    TILES 16-column tiles; split_k (None: enough for per_sm programs an SM) K ranges; ahead: 1
    or 2 groups of weights in flight beyond the one being summed (2: more bytes in flight, and a
    split's first two groups loaded before the PDL wait); x_shared (one row; None: at one row,
    for splits of up to X_SHARED_GROUPS groups): the split's x loaded once into shared memory.
    None: the settings of _ONE_ROW or _ROWS. arrivals (arrival_counts(N), zero between calls,
    as each call leaves it): the last split of a column block to finish adds the splits'
    partial sums, instead of a second launch."""
    m, k = x.shape
    n = rq.shape[0] * 16
    assert rq.shape[1] * CHUNK == k and x.dtype in _MAGIC
    assert x.stride(1) == 1 and x.stride(0) % 2 == 0 and x.data_ptr() % 16 == 0
    defaults = _ONE_ROW if m == 1 else _ROWS
    warps, tiles, per_sm = (warps or defaults[0], tiles or defaults[1], per_sm or defaults[2])
    ahead = ahead or defaults[3]
    rows = rows or (8 if m <= 16 else 32)
    assert n % (16 * warps * tiles) == 0, f"N={n} is not a multiple of {16 * warps * tiles}"
    assert ahead in (1, 2), f"ahead={ahead}: 1 or 2 groups"
    groups = k // group_size
    programs = n // (16 * warps * tiles) * triton.cdiv(m, rows)
    num_splits, per_split = _num_splits(split_k, programs, groups, per_sm, x.device)
    if x_shared is None:
        x_shared = m == 1 and per_split <= X_SHARED_GROUPS
    assert not x_shared or m == 1, "x_shared takes one row"

    pdl = pdl_options(x.device)
    block = 16 * warps * tiles
    # SwiGLU's gate and up blocks pair up only where N / 2 holds whole blocks
    fused = arrivals is not None and num_splits > 1 and not (swiglu and n // 2 % block)
    if fused:
        counts = n // block // (2 if swiglu else 1) * triton.cdiv(m, rows)
        assert arrivals.dtype == torch.int32 and arrivals.numel() >= counts, \
            f"arrivals: {counts} int32 counts needed, got {arrivals.numel()} {arrivals.dtype}"

    def launch(target: torch.Tensor, stride_split: int, total: torch.Tensor | None = None):
        _awq_mma_kernel[(n // block, num_splits, triton.cdiv(m, rows))](
            x.view(torch.int32), rq, qzeros, scales, target, m, n, k, n // 8, x.stride(0), n,
            stride_split, per_split, _MAGIC[x.dtype], rq if arrivals is None else arrivals,
            target if total is None else total, num_splits, GROUP=group_size, WARPS=warps,
            TILES=tiles, ROWS=rows, BF16=x.dtype == torch.bfloat16, USE_PDL=pdl["launch_pdl"],
            AHEAD=ahead, X_SPLIT=triton.next_power_of_2(per_split) if x_shared else 0,
            SUM_SPLITS=triton.next_power_of_2(num_splits) if fused else 0,
            SWIGLU=swiglu, launch_pdl=pdl["launch_pdl"], num_warps=warps,
            maxnreg=max_registers(fused, rows, tiles, ahead))

    if not fused:
        return _launch_split(launch, num_splits, m, n, x, pdl, swiglu)
    total = torch.empty(m, n // 2 if swiglu else n, dtype=x.dtype, device=x.device)
    launch(torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device), m * n, total)
    return total


def awq_gemm_repacked(x: torch.Tensor, rq: torch.Tensor, qzeros: torch.Tensor,
                      scales: torch.Tensor, group_size: int, *, block_m: int | None = None,
                      tiles: int | None = None, split_k: int | None = None, group_m: int = 8,
                      num_warps: int | None = None, num_stages: int = 3,
                      swiglu: bool = False) -> torch.Tensor:
    """x [M, K] (fp16/bf16) @ the repacked AWQ weight [K, N] -> [M, N] in x's dtype, each
    program's weight tile (tiles x 16 columns by a group) dequantized in registers for tl.dot,
    as awq_gemm does AutoAWQ's; swiglu as in awq_mma_gemv."""
    m, k = x.shape
    n = rq.shape[0] * 16
    assert rq.shape[1] * CHUNK == k and x.dtype in _MAGIC and x.stride(1) == 1
    block_m = block_m or _GEMM_TILE[0]
    tiles = tiles or next(t for t in (_GEMM_TILE[1], 8, 4, 2, 1) if n % (16 * t) == 0)
    assert n % (16 * tiles) == 0, f"N={n} is not a multiple of {16 * tiles}"
    programs = triton.cdiv(m, block_m) * (n // (16 * tiles))
    num_splits, per_split = _num_splits(split_k, programs, k // group_size,
                                        _GEMM_PROGRAMS_PER_SM, x.device)
    pdl = pdl_options(x.device)

    def launch(target: torch.Tensor, stride_split: int) -> None:
        _awq_gemm_repacked_kernel[(programs, num_splits)](
            x, rq, qzeros, scales, target, m, n, k, x.stride(0), n, stride_split, per_split,
            BLOCK_M=block_m, TILES=tiles, GROUP=group_size, GROUP_M=group_m, **pdl,
            num_warps=num_warps or _GEMM_TILE[2], num_stages=num_stages)

    return _launch_split(launch, num_splits, m, n, x, pdl, swiglu)


def awq_mma_linear(x: torch.Tensor, rq: torch.Tensor, qzeros: torch.Tensor,
                   scales: torch.Tensor, group_size: int, arrivals: torch.Tensor | None = None,
                   swiglu: bool = False) -> torch.Tensor:
    """awq_linear for the repacked weight, fp16/bf16: the tensor-core GEMV up to MMA_MAX_ROWS
    rows (arrivals as there), awq_gemm_repacked up to GEMM_MAX_ROWS; past that (float32 x too)
    the dense weight (awq_dequantize_repacked) and cuBLAS."""
    if x.shape[0] <= MMA_MAX_ROWS and x.dtype in _MAGIC:
        return awq_mma_gemv(x, rq, qzeros, scales, group_size, arrivals, swiglu=swiglu)
    if x.shape[0] <= GEMM_MAX_ROWS and x.dtype in _MAGIC:
        return awq_gemm_repacked(x, rq, qzeros, scales, group_size, swiglu=swiglu)
    y = x @ awq_dequantize_repacked(rq, qzeros, scales, group_size, x.dtype).t()
    return silu_and_mul(y) if swiglu else y
