"""Rotary position embedding, in place on q and k, optionally after Qwen3's per-head RMSNorm.

Programs are (token, head chunk): chunk c rotates query heads [c * Q_BLOCK, (c + 1) * Q_BLOCK)
and key heads [c * K_BLOCK, (c + 1) * K_BLOCK), so every program carries a balanced share.
Neox style rotates the two halves of each head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
as Hugging Face's Llama/Qwen3 do; GPT-J style (is_neox=False) rotates interleaved pairs
(x[2i], x[2i+1]) instead.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.norm import apply_rms


@triton.jit
def _rotate_heads(
    x_ptr,  # [num_tokens, num_heads, 2 * HALF], rotated in place
    token,
    head0,  # first head of this program's chunk
    num_heads,
    stride_t,
    stride_h,
    cos,  # [HALF] float32
    sin,  # [HALF] float32
    w_ptr,  # [2 * HALF] per-head RMSNorm weight (HAS_NORM)
    eps,
    HEADS: tl.constexpr,  # heads per program
    HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    heads = head0 + tl.arange(0, HEADS)
    offs = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    base = x_ptr + token * stride_t + heads[:, None] * stride_h
    if IS_NEOX:
        idx1 = offs
        idx2 = offs + HALF
    else:
        idx1 = 2 * offs
        idx2 = 2 * offs + 1
    x1 = tl.load(base + idx1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + idx2[None, :], mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        x1 = apply_rms(x1, rstd, tl.load(w_ptr + idx1), dtype).to(tl.float32)
        x2 = apply_rms(x2, rstd, tl.load(w_ptr + idx2), dtype).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(base + idx1[None, :], out1.to(dtype), mask=mask)
    tl.store(base + idx2[None, :], out2.to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,  # [num_tokens] int64 or int32
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos (HEAD_DIM / 2), then sin
    q_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    k_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    num_heads,
    num_kv_heads,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK: tl.constexpr,  # query heads per program
    K_BLOCK: tl.constexpr,  # key heads per program
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + offs)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + offs)
    _rotate_heads(q_ptr, token, chunk * Q_BLOCK, num_heads, stride_qt, stride_qh, cos, sin,
                  q_norm_ptr, eps, Q_BLOCK, HALF, IS_NEOX, HAS_NORM)
    _rotate_heads(k_ptr, token, chunk * K_BLOCK, num_kv_heads, stride_kt, stride_kh, cos, sin,
                  k_norm_ptr, eps, K_BLOCK, HALF, IS_NEOX, HAS_NORM)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in
    place by positions [num_tokens]. cos_sin_cache [max_position, head_dim] float32 holds cos in
    its first half and sin in its second. With q_norm_weight/k_norm_weight [head_dim], each head is
    first RMS-normalised (Qwen3's q_norm/k_norm), in the same pass."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[1] == head_dim, "rotary_dim must equal head_dim"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "give both q and k norm weights, or neither"
    if num_tokens == 0:
        return
    # NOTE: measured on an H200 at 8192 tokens, 32/8 heads, d=128: the plain rotation is fastest
    # with one program of 8 warps per token (87% of copy bandwidth); with the norm's per-head
    # reductions, two programs of 2 warps per token (82%, against 79% for one).
    chunks = min(2 if has_norm else 1, num_heads)
    q_block = triton.next_power_of_2(triton.cdiv(num_heads, chunks))
    k_block = triton.next_power_of_2(triton.cdiv(num_kv_heads, chunks))
    grid = (num_tokens, max(triton.cdiv(num_heads, q_block), triton.cdiv(num_kv_heads, k_block)))
    _rotary_embedding_kernel[grid](
        positions, q, k, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        num_heads, num_kv_heads, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HEAD_DIM=head_dim, Q_BLOCK=q_block, K_BLOCK=k_block, IS_NEOX=is_neox,
        HAS_NORM=has_norm, num_warps=2 if has_norm else max(1, min(8, q_block * head_dim // 256)),
    )
