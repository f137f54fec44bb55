"""Flash attention over contiguous variable-length sequences (prefill without a KV cache).

Same tiling as paged.py (GQA-packed query tiles, shared inner loop) with K/V read as plain rows.
Causal masking is aligned to the bottom-right when seqlen_q != seqlen_k, as in FlashAttention:
query i of a run of length Lq over Lk keys sees keys 0 .. Lk - Lq + i; a row that sees no key
(Lq > Lk) gets zeros.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.attention.common import (
    LOG2E,
    M_FLOOR,
    TileConfig,
    attend_key_range,
    batch_tile_config,
    causal_bounds,
    find_seq,
    query_rows,
)
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit(do_not_specialize=["num_seqs"])  # changes from step to step
def _varlen_attention_kernel(
    q_ptr,  # [total_q, num_heads, HEAD_DIM]
    k_ptr,  # [total_k, num_kv_heads, HEAD_DIM]
    v_ptr,  # [total_k, num_kv_heads, HEAD_DIM]
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32
    cu_seqlens_k_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [total_q, num_heads, HEAD_DIM]
    num_seqs,
    qk_scale,  # softmax_scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr,  # k/v have 2^31 elements or more
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and HEAD_DIM >= 16)
    tl.static_assert((HEAD_DIM & (HEAD_DIM - 1)) == 0, "HEAD_DIM must be a power of two")
    kv_head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = find_seq(cu_seqlens_q_ptr, num_seqs, tile, GROUP, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    row0 = (tile - (q_start * GROUP // BLOCK_M + seq)) * BLOCK_M
    if row0 >= q_len * GROUP:
        return
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start

    tokens, heads, row_ok, q_pos = query_rows(row0, q_start, q_len, k_len, kv_head, GROUP,
                                              BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
    full_hi, masked_hi = causal_bounds(row0, q_len, k_len, 0, k_len, CAUSAL, GROUP, BLOCK_M,
                                       BLOCK_N)

    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    v_base = v_ptr + k_start.to(tl.int64) * stride_kt + kv_head * stride_kh
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], M_FLOOR, dtype=tl.float32)
    acc, l_i, m_i = attend_key_range(
        acc, l_i, m_i, q, q_pos, 0, full_hi, k_len, k_base, v_base, k_base, v_base, k_base,
        0, 0, stride_kt, 0, 0, qk_scale,
        False, CAUSAL, False, False, WIDE_OFFSETS, 1, BLOCK_N, HEAD_DIM,
    )
    acc, l_i, m_i = attend_key_range(
        acc, l_i, m_i, q, q_pos, full_hi, masked_hi, k_len, k_base, v_base, k_base, v_base,
        k_base, 0, 0, stride_kt, 0, 0, qk_scale,
        True, CAUSAL, False, False, WIDE_OFFSETS, 1, BLOCK_N, HEAD_DIM,
    )
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool = True,
    out: torch.Tensor | None = None,
    *,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Attention over packed sequences: q [total_q, num_heads, head_dim], k/v [total_k,
    num_kv_heads, head_dim], cu_seqlens_q/cu_seqlens_k [num_seqs + 1] int32. Returns
    [total_q, num_heads, head_dim]. max_seqlen_q/max_seqlen_k are host ints for grid sizing;
    config overrides the tiles the shapes would get (tests, benchmarks)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(2) == 1 and k.stride(2) == 1, "head_dim must be contiguous"
    assert v.stride() == k.stride(), "k and v must share a layout"
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if total_q == 0:
        return out
    if config is None:
        config = batch_tile_config(max_seqlen_q, total_q, num_seqs, group, head_dim)
    num_tiles = total_q * group // config.block_m + num_seqs
    _varlen_attention_kernel[(num_kv_heads, num_tiles)](
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, num_seqs, softmax_scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal, WIDE_OFFSETS=k.numel() >= 2**31, **pdl_options(q.device),
        **config.launch_options(),
    )
    return out
