"""Linear layers for a few rows (decode at batch 1-4): y[M, N] = x[M, K] @ w[N, K]^T.

At a few rows a linear layer is a pure read of its weight, so the kernel's only job is to stream
w at the memory's bandwidth. Tensor cores would pad M to 16 and stage every tile through shared
memory for nothing; here each program owns BLOCK_N output features over the whole K, multiplies
its weight tiles by x on the CUDA cores into an fp32 [M, BLOCK_N, BLOCK_K] accumulator and
reduces over K once at the end. One launch, no atomics, no split-K partials: deterministic.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.activation import silu_times
from echo_kernels.device import sm_count
from echo_kernels.norm import apply_rms
from echo_kernels.pdl import pdl_options, wait_for_inputs

MAX_ROWS = 4  # beyond this the accumulator outgrows the registers: cuBLAS is the better choice


@triton.jit
def weight_tile(w_ptrs, cols, offs_k, k0, N, K, UNMASKED: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of a row-major [N, K] weight at rows `cols`, columns k0 +
    offs_k (w_ptrs: those of k0 = 0); zeros past N and K unless UNMASKED (also fused_moe's)."""
    if UNMASKED:
        return tl.load(w_ptrs + k0)
    return tl.load(w_ptrs + k0, mask=(cols[:, None] < N) & (k0 + offs_k[None, :] < K), other=0.0)


@triton.jit
def _row_ptrs(w_ptr, cols, offs_k, stride_wn):
    """[BLOCK_N, BLOCK_K] pointers to the weight rows `cols` at columns offs_k."""
    return w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]


@triton.jit
def _store_outputs(y, out_ptr, rows, outs, M, N_OUT, stride_om, SWIGLU: tl.constexpr):
    """y [M_PAD, BLOCK_N] float32 sums into out[rows, outs]. SWIGLU: y's columns are the gate
    rows, then the up rows of the same outputs; silu(gate) * up is stored, rounded as the
    separate launches round (gate and up stored in the output dtype, silu's result too)."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if SWIGLU:
        M_PAD: tl.constexpr = y.shape[0]
        HALF: tl.constexpr = y.shape[1] // 2
        gate, up = tl.split(tl.permute(tl.reshape(y.to(dtype), [M_PAD, 2, HALF]), (0, 2, 1)))
        y = silu_times(gate, up)
    out = out_ptr + rows[:, None] * stride_om + outs[None, :]
    tl.store(out, y.to(dtype), mask=(rows[:, None] < M) & (outs[None, :] < N_OUT))


@triton.jit
def _block_columns(block, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """(the weight rows, the outputs) of output block `block`: SWIGLU, outputs j with their
    gate row j and up row N / 2 + j."""
    if SWIGLU:
        HALF: tl.constexpr = BLOCK_N // 2
        offs = tl.arange(0, BLOCK_N)
        j = block * HALF + offs % HALF
        cols = tl.where(offs < HALF, j, N // 2 + j)
        outs = block * HALF + tl.arange(0, HALF)
    else:
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        outs = cols
    return cols, outs


@triton.jit
def _normed_rows(x, rows, offs_k, x_ok, K, stride_xm, resid_ptr, sum_ptr, norm_w, eps,
                 HAS_RESIDUAL: tl.constexpr):
    """RMSNorm(x + residual) of the rows x [M_PAD, BLOCK_K], rounded as fused_add_rms_norm
    rounds it (norm.py); program 0 stores the sum."""
    if HAS_RESIDUAL:
        r = tl.load(resid_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=x_ok,
                    other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + rows[:, None] * stride_xm + offs_k[None, :], x, mask=x_ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
    return apply_rms(xf, rstd, norm_w[None, :], x.dtype)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N], or [M, N / 2] (SWIGLU)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # weight rows a program (SWIGLU: half gate, half up)
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    PREFETCH: tl.constexpr,  # load the next weight tile before using this one
    WHOLE_K: tl.constexpr,  # PREFETCH with BLOCK_K >= K: one tile, all of it before the wait
    SWIGLU: tl.constexpr,  # w is [gate; up] (N = 2d): store silu(x @ gate^T) * (x @ up^T)
    USE_PDL: tl.constexpr,  # echo_kernels.pdl: the first weight tile loads before the wait
    # RMSNorm(x + residual) in place of x (WHOLE_K only): every program normalises the rows
    # for itself, program 0 stores the sum x + residual (HAS_RESIDUAL; else x is the sum)
    NORM: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = False,
    resid_ptr=None,  # [M, K], stride stride_xm
    norm_w_ptr=None,  # [K]
    sum_ptr=None,  # [M, K], stride stride_xm
    eps=0.0,
    normed_ptr=None,  # [M, K], stride stride_xm: the normed rows, stored by program 0 if given
    # WHOLE_K: a program takes blocks_per_program output blocks one after another, the next
    # block's weight tile loading while this one's is summed (its x, normed, loaded once)
    RUNS: tl.constexpr = False,
    blocks_per_program=1,
):
    tl.static_assert(WHOLE_K or not NORM, "the norm inside needs a tile over the whole of K")
    block = tl.program_id(0) * blocks_per_program if RUNS else tl.program_id(0)
    cols, outs = _block_columns(block, N, BLOCK_N, SWIGLU)
    n_out = N // 2 if SWIGLU else N
    rows = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = _row_ptrs(w_ptr, cols, offs_k, stride_wn)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    if WHOLE_K:
        # one tile holds the program's whole share: it loads before the wait (while the short
        # kernel before still runs), and no second tile is held as the loop below holds one
        w = weight_tile(w_ptrs, cols, offs_k, 0, N, K, EVEN)
        x_ok = (rows[:, None] < M) & (offs_k[None, :] < K)
        if NORM:  # a weight too: loaded before the wait
            norm_w = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0)
        wait_for_inputs(USE_PDL)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if NORM:
            x = _normed_rows(x, rows, offs_k, x_ok, K, stride_xm, resid_ptr, sum_ptr, norm_w,
                             eps, HAS_RESIDUAL)
            if normed_ptr is not None:
                if tl.program_id(0) == 0:
                    tl.store(normed_ptr + rows[:, None] * stride_xm + offs_k[None, :], x,
                             mask=x_ok)
        if RUNS:
            for i in range(blocks_per_program):
                next_cols, next_outs = _block_columns(block + i + 1, N, BLOCK_N, SWIGLU)
                # past the run (or N) no row: the mask is all false and no memory is read
                next_cols = tl.where(i + 1 < blocks_per_program, next_cols, N)
                w_next = weight_tile(_row_ptrs(w_ptr, next_cols, offs_k, stride_wn), next_cols,
                                     offs_k, 0, N, K, False)
                y = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
                _store_outputs(y, out_ptr, rows, outs, M, n_out, stride_om, SWIGLU)
                w = w_next
                outs = next_outs
        else:
            y = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
            _store_outputs(y, out_ptr, rows, outs, M, n_out, stride_om, SWIGLU)
        return
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # NOTE: Triton's software pipeliner stages loads that feed tl.dot; these feed CUDA-core
    # math, so PREFETCH double-buffers them in registers by hand to keep two tiles in flight
    if PREFETCH:
        # the weight is never written by a kernel: its first tile may load before the wait
        w_next = weight_tile(w_ptrs, cols, offs_k, 0, N, K, EVEN)
    wait_for_inputs(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w = w_next
            # past the last tile the mask is all false: no memory is read
            w_next = weight_tile(w_ptrs, cols, offs_k, k0 + BLOCK_K, N, K, False)
        else:
            w = weight_tile(w_ptrs, cols, offs_k, k0, N, K, EVEN)
        x = tl.load(x_ptrs + k0, mask=(rows[:, None] < M) & (k0 + offs_k[None, :] < K),
                    other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    _store_outputs(tl.sum(acc, axis=2), out_ptr, rows, outs, M, n_out, stride_om, SWIGLU)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, prefetch: bool = False,
                   swiglu: bool = False, programs_per_sm: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype, fp32 accumulation.
    swiglu: weight is SwiGLU's [gate; up] and the result silu(x @ gate^T) * (x @ up^T),
    [M, N / 2], each program computing block_n / 2 outputs from their gate and up rows.
    programs_per_sm (a prefetched tile over the whole of K): a program takes a run of blocks,
    so that about that many programs an SM share them, x loaded once a program and the next
    block's weight loading while one is summed."""
    m, k = x.shape
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a "
                         "contiguous K")
    # NOTE: swept on an H200 at M=1 (bench_kernels.py --only linear --sweep): 8 x 512 tiles
    # were best at Llama-3.1-8B's qkv/o_proj/down shapes. The accumulator holds
    # M_PAD * BLOCK_N * BLOCK_K floats, so K per tile shrinks as M grows.
    block_k = block_k or max(128, 512 // triton.next_power_of_2(m))
    return _launch("small_m_linear", x, weight, block_n or 8, block_k, prefetch, swiglu,
                   num_warps, num_stages=num_stages, programs_per_sm=programs_per_sm)


def small_m_normed_linear(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          block_n: int, num_warps: int = 4, swiglu: bool = False,
                          normed_out: torch.Tensor | None = None,
                          programs_per_sm: int | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """small_m_linear(RMSNorm(x + residual)) with the norm inside, one tile over the whole of
    K a block of block_n outputs: (its output, the sum x + residual, a new tensor; x itself
    when residual is None). The norm and the sum round as fused_add_rms_norm's do. normed_out
    (like x): where the normed rows go too, for other layers that read them. A program takes
    one block, or with programs_per_sm a run of blocks, so that about that many programs an
    SM share them: the norm once a program, and the next block's weight loading while one is
    summed."""
    k = x.shape[1]
    if (weight.shape[1] != k or norm_weight.shape != (k,) or not x.is_contiguous()
            or weight.stride(1) != 1 or (residual is not None and residual.shape != x.shape)
            or (normed_out is not None and (normed_out.shape != x.shape
                                            or not normed_out.is_contiguous()))):
        raise ValueError(f"x {tuple(x.shape)}, residual, norm weight {tuple(norm_weight.shape)}"
                         f" and weight {tuple(weight.shape)} must share a contiguous K")
    total = x if residual is None else torch.empty_like(x)
    out = _launch("small_m_normed_linear", x, weight, block_n, triton.next_power_of_2(k), True,
                  swiglu, num_warps, NORM=True, HAS_RESIDUAL=residual is not None,
                  resid_ptr=x if residual is None else residual.contiguous(),
                  norm_w_ptr=norm_weight, sum_ptr=total, eps=eps, normed_ptr=normed_out,
                  programs_per_sm=programs_per_sm)
    return out, total


def _launch(name: str, x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int,
            prefetch: bool, swiglu: bool, num_warps: int, num_stages: int = 3,
            programs_per_sm: int | None = None, **norm) -> torch.Tensor:
    """The kernel's launch for both entry points (shapes already checked but the rows and
    SwiGLU's halves): its output [M, N], or [M, N / 2] with swiglu; programs_per_sm (whole-K
    tiles): runs of blocks a program, for about that many programs an SM."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{name} takes 1..{MAX_ROWS} rows, got {m}")
    if swiglu and (n % 2 or block_n < 2):
        raise ValueError(f"{name}(swiglu=True): {n} weight rows are not gate and up halves, "
                         f"or block_n {block_n} holds no pair")
    outputs, per_program = (n // 2, block_n // 2) if swiglu else (n, block_n)
    out = torch.empty(m, outputs, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(outputs, per_program)
    per_run = 1
    if programs_per_sm is not None:
        if not (prefetch and block_k >= k):
            raise ValueError(f"{name}: programs_per_sm takes a tile over the whole of K")
        per_run = triton.cdiv(blocks, programs_per_sm * sm_count(x.device, 2))
    _small_m_linear_kernel[(triton.cdiv(blocks, per_run),)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=outputs % per_program == 0 and k % block_k == 0, PREFETCH=prefetch,
        WHOLE_K=prefetch and block_k >= k, SWIGLU=swiglu, **pdl_options(x.device), **norm,
        RUNS=programs_per_sm is not None, blocks_per_program=per_run, num_warps=num_warps,
        num_stages=num_stages)
    return out
