"""Write new tokens' K/V into their paged-cache slots, quantising to int8 when the cache is int8.

int8 is symmetric per (token, KV head): scale = absmax / 127 over head_dim, q = round(x / scale),
stored next to the cache in k_scale/v_scale [num_blocks, block_size, num_kv_heads] float32.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def quantize_rows(
    x,  # [HEADS_PAD, HEAD_DIM] float32 (or part of each row)
    absmax,  # [HEADS_PAD] float32, max |x| over each whole row
):
    """Symmetric int8 per row: (values, scale)."""
    inv = tl.where(absmax > 0.0, 127.0 / absmax, 0.0)
    y = x * inv[:, None]
    # NOTE: round half away from zero; floor/ceil keep this portable to the interpreter.
    y = tl.where(y >= 0.0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y.to(tl.int8), absmax / 127.0


@triton.jit
def store_cache_rows(
    cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (IS_INT8_KV)
    cache_off,  # [ROWS, HEAD_DIM] element offsets of each row's values
    scale_off,  # [ROWS] offsets of each row's scale (IS_INT8_KV)
    x,  # [ROWS, HEAD_DIM] the rows, in the model's dtype
    row_ok,  # [ROWS]
    IS_INT8_KV: tl.constexpr,
):
    """Rows into the cache, quantised to int8 per row when the cache is int8."""
    if IS_INT8_KV:
        xf = x.to(tl.float32)
        x_q, scale = quantize_rows(xf, tl.max(tl.abs(xf), 1))
        tl.store(cache_ptr + cache_off, x_q, mask=row_ok[:, None])
        tl.store(scale_ptr + scale_off, scale, mask=row_ok)
    else:
        tl.store(cache_ptr + cache_off, x.to(cache_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _store_kv_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    v_ptr,  # [num_tokens, num_kv_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (IS_INT8_KV)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (IS_INT8_KV)
    slot_mapping_ptr,  # [num_tokens] int64 or int32; -1 = skip
    num_kv_heads,
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_sb,
    stride_st,
    stride_sh,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    IS_INT8_KV: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    head_ok = heads < num_kv_heads
    offs = heads[:, None] * stride_kh + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs, mask=head_ok[:, None])
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                mask=head_ok[:, None])
    cache_off = block * stride_cb + offset * stride_ct + heads[:, None] * stride_ch
    cache_off = cache_off + offs_d[None, :]
    scale_off = block * stride_sb + offset * stride_st + heads * stride_sh
    store_cache_rows(k_cache_ptr, k_scale_ptr, cache_off, scale_off, k, head_ok, IS_INT8_KV)
    store_cache_rows(v_cache_ptr, v_scale_ptr, cache_off, scale_off, v, head_ok, IS_INT8_KV)


def checked_cache_scales(k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """Check a layer's cache pair; returns (is_int8, k_scale, v_scale), the scales replaced by
    a placeholder tensor (never read) when the cache is not int8."""
    assert v_cache.stride() == k_cache.stride(), "k_cache and v_cache must share a layout"
    if k_cache.dtype != torch.int8:
        return False, k_cache, k_cache
    assert k_scale is not None and v_scale is not None, "int8 caches need k_scale/v_scale"
    assert v_scale.stride() == k_scale.stride()
    return True, k_scale, v_scale


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k/v [num_tokens, num_kv_heads, head_dim] -> cache slots `slot_mapping` [num_tokens]
    (slot = block * block_size + offset; -1 skips the token). In place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1
    is_int8, k_scale, v_scale = checked_cache_scales(k_cache, v_cache, k_scale, v_scale)
    heads_pad = triton.next_power_of_2(num_kv_heads)
    _store_kv_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, num_kv_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        HEAD_DIM=head_dim, HEADS_PAD=heads_pad, IS_INT8_KV=is_int8, **pdl_options(k.device),
        num_warps=4 if heads_pad * head_dim >= 1024 else 2,
    )
