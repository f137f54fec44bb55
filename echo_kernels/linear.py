"""Linear layers for a few rows (decode at small batch): y[M, N] = x[M, K] @ w[N, K]^T.

At M <= 16 a linear layer is a pure read of its weight, so the kernel's only job is to stream
w at the memory's bandwidth: each program owns BLOCK_N output features and one K slice
(split-K fills the SMs when N alone cannot), multiplies the padded x tile on tensor cores, and
writes fp32 partial sums; a second pass adds the slices in a fixed order, so results are
deterministic (no atomics).
"""

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # the x tile is padded to this many rows (tl.dot's smallest M)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    part_ptr,  # [SPLIT_K, M, N] float32
    M,
    N,
    K,
    k_per_split,  # a multiple of BLOCK_K
    stride_xm,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    out = part_ptr + (split * M + rows[:, None]) * N + cols[None, :]
    tl.store(out, acc, mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sum_splits_kernel(
    part_ptr,  # [SPLIT_K, M * N] float32
    out_ptr,  # [M * N]
    total,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, split_k: int | None = None,
                   block_n: int = 64, block_k: int = 256) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K] -> [M, N] in x's dtype, fp32 accumulation."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k
    assert x.stride(1) == 1 and weight.stride(1) == 1
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:  # about 4 programs per SM, each streaming at least 4 K tiles
        split_k = max(1, min(triton.cdiv(4 * _num_sms(x.device), n_blocks),
                             triton.cdiv(k, 4 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    parts = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _small_m_linear_kernel[(n_blocks, split_k)](
        x, weight, parts, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    total = m * n
    _sum_splits_kernel[(triton.cdiv(total, 1024),)](parts, out, total, SPLIT_K=split_k,
                                                    BLOCK=1024)
    return out
