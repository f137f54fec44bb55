"""Rotary position embedding, in place on q and k, optionally after Qwen3's per-head RMSNorm, and
optionally writing the rotated k and v into the paged KV cache in the same launch (what
store_kv_cache does, one launch per layer fewer).

Programs are (token, head chunk): chunk c rotates query heads [c * Q_BLOCK, (c + 1) * Q_BLOCK)
and key heads [c * K_BLOCK, (c + 1) * K_BLOCK), so every program carries a balanced share.
Neox style rotates the two halves of each head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
as Hugging Face's Llama/Qwen3 do; GPT-J style (is_neox=False) rotates interleaved pairs
(x[2i], x[2i+1]) instead.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.cache import checked_cache_scales, quantize_rows
from echo_kernels.norm import apply_rms
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _rotated_pairs(HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """Offsets within a head of the two elements each rotation pairs: halves, or neighbours."""
    offs = tl.arange(0, HALF)
    if IS_NEOX:
        return offs, offs + HALF
    return 2 * offs, 2 * offs + 1


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
    """Rotate one token's heads of a chunk in place; returns the rotated halves (x's dtype)."""
    heads = head0 + tl.arange(0, HEADS)
    mask = (heads < num_heads)[:, None]
    base = x_ptr + token * stride_t + heads[:, None] * stride_h
    idx1, idx2 = _rotated_pairs(HALF, IS_NEOX)
    x1 = tl.load(base + idx1[None, :], mask=mask, other=0.0)
    x2 = tl.load(base + idx2[None, :], mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
        x1 = apply_rms(x1, rstd, tl.load(w_ptr + idx1), dtype).to(tl.float32)
        x2 = apply_rms(x2, rstd, tl.load(w_ptr + idx2), dtype).to(tl.float32)
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(dtype)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(dtype)
    tl.store(base + idx1[None, :], out1, mask=mask)
    tl.store(base + idx2[None, :], out2, mask=mask)
    return out1, out2


@triton.jit
def rotated_rows(
    x_ptr,
    row_off,  # [ROWS] element offset of each row (one head of one token)
    row_ok,  # [ROWS]
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos, then sin
    stride_cos,
    pos,  # the rows' position (one token)
    w_ptr,  # [HEAD_DIM] per-head RMSNorm weight (HAS_NORM)
    eps,
    HEAD_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rows of heads, normalised (HAS_NORM) and rotated as _rotate_heads does, without writing
    them back: [ROWS, HEAD_DIM] in x's dtype. Each element is loaded with its rotation partner,
    so the rows come back in their own layout."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    if IS_NEOX:
        partner = (offs + HALF) % HEAD_DIM
        first = offs < HALF
        pair = offs % HALF
    else:
        partner = offs ^ 1
        first = offs % 2 == 0
        pair = offs // 2
    mask = row_ok[:, None]
    x = tl.load(x_ptr + row_off[:, None] + offs[None, :], mask=mask, other=0.0)
    xp = tl.load(x_ptr + row_off[:, None] + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)
        x = apply_rms(x, rstd, tl.load(w_ptr + offs), dtype).to(tl.float32)
        xp = apply_rms(xp, rstd, tl.load(w_ptr + partner), dtype).to(tl.float32)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + pair)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + pair)
    # the first of a pair: x1 cos - x2 sin; the second: x2 cos + x1 sin
    return (x * cos[None, :] + tl.where(first[None, :], -xp, xp) * sin[None, :]).to(dtype)


@triton.jit
def _store_row_halves(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (IS_INT8_KV)
    row,  # [HEADS] element offset of each head's cache row
    scale_row,  # [HEADS] offset of each head's scale
    x1,  # [HEADS, HALF] the halves of each row at idx1 / idx2
    x2,
    idx1,
    idx2,
    head_ok,  # [HEADS]
    IS_INT8_KV: tl.constexpr,
):
    """Cache rows given as two halves, quantised per row as store_kv_cache does."""
    mask = head_ok[:, None]
    if IS_INT8_KV:
        x1 = x1.to(tl.float32)
        x2 = x2.to(tl.float32)
        absmax = tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1))
        q1, scale = quantize_rows(x1, absmax)
        q2, _ = quantize_rows(x2, absmax)
        tl.store(cache_ptr + row[:, None] + idx1[None, :], q1, mask=mask)
        tl.store(cache_ptr + row[:, None] + idx2[None, :], q2, mask=mask)
        tl.store(scale_ptr + scale_row, scale, mask=head_ok)
    else:
        dtype = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + row[:, None] + idx1[None, :], x1.to(dtype), mask=mask)
        tl.store(cache_ptr + row[:, None] + idx2[None, :], x2.to(dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,  # [num_tokens] int64 or int32
    q_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos (HEAD_DIM / 2), then sin
    q_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    k_norm_ptr,  # [HEAD_DIM] (HAS_NORM)
    v_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM] (STORE_KV)
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM] (STORE_KV)
    v_cache_ptr,
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (IS_INT8_KV)
    v_scale_ptr,
    slot_mapping_ptr,  # [num_tokens]; -1 = do not store (STORE_KV)
    num_heads,
    num_kv_heads,
    eps,
    block_size,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    Q_BLOCK: tl.constexpr,  # query heads per program
    K_BLOCK: tl.constexpr,  # key heads per program
    IS_NEOX: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    IS_INT8_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_cos + offs)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + offs)
    _rotate_heads(q_ptr, token, chunk * Q_BLOCK, num_heads, stride_qt, stride_qh, cos, sin,
                  q_norm_ptr, eps, Q_BLOCK, HALF, IS_NEOX, HAS_NORM)
    k1, k2 = _rotate_heads(k_ptr, token, chunk * K_BLOCK, num_kv_heads, stride_kt, stride_kh,
                           cos, sin, k_norm_ptr, eps, K_BLOCK, HALF, IS_NEOX, HAS_NORM)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            heads = chunk * K_BLOCK + tl.arange(0, K_BLOCK)
            head_ok = heads < num_kv_heads
            idx1, idx2 = _rotated_pairs(HALF, IS_NEOX)
            block = slot // block_size
            offset = slot % block_size
            row = block * stride_cb + offset * stride_ct + heads * stride_ch
            scale_row = block * stride_sb + offset * stride_st + heads * stride_sh
            v_base = v_ptr + token * stride_vt + heads[:, None] * stride_vh
            v1 = tl.load(v_base + idx1[None, :], mask=head_ok[:, None], other=0.0)
            v2 = tl.load(v_base + idx2[None, :], mask=head_ok[:, None], other=0.0)
            _store_row_halves(k_cache_ptr, k_scale_ptr, row, scale_row, k1, k2, idx1, idx2,
                              head_ok, IS_INT8_KV)
            _store_row_halves(v_cache_ptr, v_scale_ptr, row, scale_row, v1, v2, idx1, idx2,
                              head_ok, IS_INT8_KV)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in
    place by positions [num_tokens]. cos_sin_cache [max_position, head_dim] float32 holds cos in
    its first half and sin in its second. With q_norm_weight/k_norm_weight [head_dim], each head is
    first RMS-normalised (Qwen3's q_norm/k_norm), in the same pass. With k_cache/v_cache (and v,
    slot_mapping, int8 scales), the rotated k and v also go into the cache exactly as
    store_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale) would write them."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert cos_sin_cache.shape[1] == head_dim, "rotary_dim must equal head_dim"
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    has_norm = q_norm_weight is not None
    assert has_norm == (k_norm_weight is not None), "give both q and k norm weights, or neither"
    store_kv = k_cache is not None
    if store_kv:
        assert v is not None and v_cache is not None and slot_mapping is not None
        assert v.stride(2) == 1 and k_cache.stride(3) == 1
        is_int8, k_scale, v_scale = checked_cache_scales(k_cache, v_cache, k_scale, v_scale)
    else:
        is_int8 = False
        v = k_cache = v_cache = k_scale = v_scale = slot_mapping = k  # placeholders, never read
    if num_tokens == 0:
        return
    # NOTE: measured on an H200 at 8192 tokens, 32/8 heads, d=128: the plain rotation is fastest
    # with one program of 8 warps per token; with the norm's per-head reductions, two programs
    # of 2 warps per token beat one (docs/benchmarks.md, Kernels; History 148e3a5).
    chunks = min(2 if has_norm else 1, num_heads)
    q_block = triton.next_power_of_2(triton.cdiv(num_heads, chunks))
    k_block = triton.next_power_of_2(triton.cdiv(num_kv_heads, chunks))
    grid = (num_tokens, max(triton.cdiv(num_heads, q_block), triton.cdiv(num_kv_heads, k_block)))
    _rotary_embedding_kernel[grid](
        positions, q, k, cos_sin_cache,
        q_norm_weight if has_norm else q, k_norm_weight if has_norm else k,
        v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        num_heads, num_kv_heads, eps, k_cache.shape[1] if store_kv else 1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), *(k_cache.stride()[:3] if store_kv else (0, 0, 0)),
        *(k_scale.stride() if is_int8 else (0, 0, 0)),
        HEAD_DIM=head_dim, Q_BLOCK=q_block, K_BLOCK=k_block, IS_NEOX=is_neox,
        HAS_NORM=has_norm, STORE_KV=store_kv, IS_INT8_KV=is_int8, **pdl_options(q.device),
        num_warps=2 if has_norm else max(1, min(8, q_block * head_dim // 256)),
    )
