"""Linear layers for a few rows (decode at batch 1-4): y[M, N] = x[M, K] @ w[N, K]^T.

At a few rows a linear layer is a pure read of its weight, so the kernel's only job is to stream
w at the memory's bandwidth. Tensor cores would pad M to 16 and stage every tile through shared
memory for nothing; here each program owns BLOCK_N output features over the whole K, multiplies
its weight tiles by x on the CUDA cores into an fp32 [M, BLOCK_N, BLOCK_K] accumulator and
reduces over K once at the end. One launch, no atomics, no split-K partials: deterministic.

At batch 1 every launch around a GEMV costs ~2-3 us however little it does, so the kernel can
take over the work next to it in a decoder layer:
- `residual=`: the residual add after o_proj and down_proj. Each program adds the residual's
  entries for its own output features, so the add reads nothing twice;
- `rms_eps=`: the RMSNorm before qkv and gate/up, whose weight the model folded into this
  layer's weight (w[n, k] * g[k]). What is left of the norm is the row's 1/rms, one factor on
  the finished sums (sum over k of w[n, k] g[k] x[k] rstd = rstd * sum(w' x)); every program
  reads all of x anyway, so it accumulates the sum of squares on the way;
- `gated=True`: SwiGLU after a [2N, K] gate/up weight. Each program reads its gate rows and the
  matching up rows and writes silu(gate) * up.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs

MAX_ROWS = 4  # beyond this the accumulator outgrows the registers: cuBLAS is the better choice


@triton.jit
def _weight_tile(w_ptrs, cols, offs_k, k0, N, K, UNMASKED: tl.constexpr):
    if UNMASKED:
        return tl.load(w_ptrs + k0)
    return tl.load(w_ptrs + k0, mask=(cols[:, None] < N) & (k0 + offs_k[None, :] < K), other=0.0)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K], or [2N, K] (gate rows, then up rows) when GATED
    out_ptr,  # [M, N]
    residual_ptr,  # [M, N] (ADD_RESIDUAL): added to the output
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    stride_rm,
    eps,
    M_PAD: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    PREFETCH: tl.constexpr,  # load the next weight tile before using this one
    RMS_SCALE: tl.constexpr,  # y = (x @ w^T) * rsqrt(mean(x^2) + eps), per row
    GATED: tl.constexpr,  # y = silu(x @ gate^T) * (x @ up^T)
    ADD_RESIDUAL: tl.constexpr,  # y = x @ w^T + residual, rounded in between as the model does
    USE_PDL: tl.constexpr,  # echo_kernels.pdl: the first weight tile loads before the wait
):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = w_ptrs + N * stride_wn  # the up rows matching these gate rows
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)  # dropped unless GATED
    sum_sq = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)  # dropped unless RMS_SCALE
    # NOTE: Triton's software pipeliner stages loads that feed tl.dot; these feed CUDA-core
    # math, so PREFETCH double-buffers them in registers by hand to keep two tiles in flight
    if PREFETCH:
        # the weight is never written by a kernel: its first tile may load before the wait
        w_next = _weight_tile(w_ptrs, cols, offs_k, 0, N, K, EVEN)
        if GATED:
            u_next = _weight_tile(u_ptrs, cols, offs_k, 0, N, K, EVEN)
    wait_for_inputs(USE_PDL)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w = w_next
            # past the last tile the mask is all false: no memory is read
            w_next = _weight_tile(w_ptrs, cols, offs_k, k0 + BLOCK_K, N, K, False)
            if GATED:
                u = u_next
                u_next = _weight_tile(u_ptrs, cols, offs_k, k0 + BLOCK_K, N, K, False)
        else:
            w = _weight_tile(w_ptrs, cols, offs_k, k0, N, K, EVEN)
            if GATED:
                u = _weight_tile(u_ptrs, cols, offs_k, k0, N, K, EVEN)
        x = tl.load(x_ptrs + k0, mask=(rows[:, None] < M) & (k0 + offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        if RMS_SCALE:
            sum_sq += x * x
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        if GATED:
            acc_up += u.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if RMS_SCALE:
        rstd = tl.math.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)
        y = y * rstd[:, None]
    dtype = out_ptr.dtype.element_ty
    if GATED:
        up = tl.sum(acc_up, axis=2)
        if RMS_SCALE:
            up = up * rstd[:, None]
        # each product rounded to the output dtype first, as the separate launches would be
        gate = y.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.math.exp2(-gate * 1.4426950408889634))).to(dtype)
        y = act.to(tl.float32) * up.to(dtype).to(tl.float32)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask,
                    other=0.0)
        y = y.to(dtype).to(tl.float32) + r.to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(dtype), mask=mask)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4, num_stages: int = 3,
                   prefetch: bool = False, *, gated: bool = False, rms_eps: float | None = None,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype, fp32 accumulation.

    gated: weight is [2N, K], gate rows then up rows; returns silu(x @ gate^T) * (x @ up^T).
    rms_eps: x @ weight^T is scaled by each row's rsqrt(mean(x^2) + rms_eps), which is
    rms_norm(x) @ weight^T for a norm whose weight is folded into `weight`.
    residual [M, N]: returns x @ weight^T + residual, the product rounded to x's dtype first.
    """
    m, k = x.shape
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_m_linear takes 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a "
                         "contiguous K")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"a gated weight stacks gate and up rows: {weight.shape[0]} rows")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} must be the output's shape ({m}, {n})")
    m_pad = triton.next_power_of_2(m)
    # NOTE: swept on an H200 at M=1 (bench_kernels.py --only linear --sweep): 8 x 512 tiles
    # were best at Llama-3.1-8B's qkv/o_proj/down shapes. The accumulator holds
    # M_PAD * BLOCK_N * BLOCK_K floats, so K per tile shrinks as M grows.
    block_n = block_n or 8
    block_k = block_k or max(128, 512 // m_pad)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    even = n % block_n == 0 and k % block_k == 0
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, x if residual is None else residual, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), 0 if residual is None else residual.stride(0),
        1e-6 if rms_eps is None else rms_eps, M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=even, PREFETCH=prefetch, RMS_SCALE=rms_eps is not None, GATED=gated,
        ADD_RESIDUAL=residual is not None, **pdl_options(x.device), num_warps=num_warps,
        num_stages=num_stages)
    return out
