"""Linear layers for a few rows (decode at batch 1-4): y[M, N] = x[M, K] @ w[N, K]^T.

At a few rows a linear layer is a pure read of its weight, so the kernel's only job is to stream
w at the memory's bandwidth. Tensor cores would pad M to 16 and stage every tile through shared
memory for nothing; here each program owns BLOCK_N output features over the whole K, multiplies
its weight tiles by x on the CUDA cores into an fp32 [M, BLOCK_N, BLOCK_K] accumulator and
reduces over K once at the end.

A layer with few output features (a small model's o_proj and down: 1,024 of them) gives too few
programs for that: each walks its whole K a tile after another, a memory latency each, while
most of the GPU idles. split_k > 1 gives each column block split_k programs over parts of K;
each writes its float32 partial sums, and the last of a block to arrive (an arrival count,
reset by it for the next call) adds them in split order: still one launch, and deterministic.
"""

import torch
import triton
import triton.language as tl

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
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N]
    partial_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1; else unused)
    arrivals_ptr,  # [cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1; else unused)
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K, every split's K but the last's
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    PREFETCH: tl.constexpr,  # load the next weight tile before using this one
    USE_PDL: tl.constexpr,  # echo_kernels.pdl: the first weight tile loads before the wait
    SPLIT_K: tl.constexpr,  # programs a column block (module docstring)
):
    block = tl.program_id(0)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
    else:
        k_lo, k_hi = 0, K
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
    # NOTE: Triton's software pipeliner stages loads that feed tl.dot; these feed CUDA-core
    # math, so PREFETCH double-buffers them in registers by hand to keep two tiles in flight
    if PREFETCH:
        # the weight is never written by a kernel: its first tile may load before the wait
        w_next = weight_tile(w_ptrs, cols, offs_k, k_lo, N, k_hi, EVEN)
    wait_for_inputs(USE_PDL)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if PREFETCH:
            w = w_next
            # past the split's last tile the mask is all false: no memory is read
            w_next = weight_tile(w_ptrs, cols, offs_k, k0 + BLOCK_K, N, k_hi, False)
        else:
            w = weight_tile(w_ptrs, cols, offs_k, k0, N, K, EVEN)
        x = tl.load(x_ptrs + k0, mask=(rows[:, None] < M) & (k0 + offs_k[None, :] < K),
                    other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K > 1:
        parts = partial_ptr + rows[:, None] * N + cols[None, :]
        tl.store(parts + tl.program_id(1) * M * N, y, mask=mask)
        # every thread's stores before the arrival (the atomic releases them device-wide)
        tl.debug_barrier()
        arrival = arrivals_ptr + block
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            # the block's last split: add every split's sums in split order (deterministic)
            total = tl.zeros([M_PAD, BLOCK_N], tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(parts + split * M * N, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(arrival, 0)  # zero for the next call, which waits for this one to end
    else:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, prefetch: bool = False, split_k: int = 1,
                   arrivals: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype, fp32 accumulation.
    split_k > 1 (module docstring) needs `arrivals`: int32, zero, at least cdiv(N, block_n)
    elements on x's device, held by the caller across calls (each call leaves it zero)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"small_m_linear takes 1..{MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a "
                         "contiguous K")
    if split_k < 1:
        raise ValueError(f"split_k: must be >= 1, got {split_k}")
    m_pad = triton.next_power_of_2(m)
    # NOTE: swept on an H200 at M=1 (bench_kernels.py --only linear --sweep): 8 x 512 tiles
    # were best at Llama-3.1-8B's qkv/o_proj/down shapes. The accumulator holds
    # M_PAD * BLOCK_N * BLOCK_K floats, so K per tile shrinks as M grows.
    block_n = block_n or 8
    block_k = block_k or max(128, 512 // m_pad)
    blocks = triton.cdiv(n, block_n)
    # whole tiles a split, and no split left without one
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = out
    if split_k > 1:
        if (arrivals is None or arrivals.dtype != torch.int32 or arrivals.numel() < blocks
                or arrivals.device != x.device):
            raise ValueError(f"arrivals: split_k > 1 needs {blocks} zeroed int32 counts on "
                             f"{x.device}, got {None if arrivals is None else arrivals.shape}")
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    else:
        arrivals = out  # unused
    even = n % block_n == 0 and k % block_k == 0
    _small_m_linear_kernel[(blocks, split_k)](
        x, weight, out, partial, arrivals, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0), M_PAD=m_pad, BLOCK_N=block_n, BLOCK_K=block_k, EVEN=even,
        PREFETCH=prefetch, SPLIT_K=split_k, **pdl_options(x.device), num_warps=num_warps,
        num_stages=num_stages)
    return out
