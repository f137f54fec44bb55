"""Merge of split-KV partial results (the second half of flash decoding).

Each split left an unnormalised output `acc_s`, its running max `m_s` (log2 units) and sum `l_s`;
the exact result is sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s with m = max_s m_s. A split
that saw no key of a row holds m_s = M_FLOOR, l_s = 0 and drops out with weight 0. The merge is
a launch of its own (merge_splits) or, where the attention launch counts its splits' arrivals,
the last split's epilogue (merge_split_rows).
"""

import torch
import triton
import triton.language as tl

from echo_kernels.attention.common import M_FLOOR
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit(do_not_specialize=["num_splits"])  # changes from step to step
def _merge_splits_kernel(
    part_acc_ptr,  # [num_tokens, num_heads, num_splits, HEAD_DIM] float32
    part_ml_ptr,  # [num_tokens, num_heads, num_splits, 2] float32
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits
    m = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=float("-inf"))
    l_sum = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    w = tl.math.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l_sum, 0)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=split_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def merge_split_rows(part_acc_ptr, part_ml_ptr, out_ptr, stride_ot, stride_oh, q_start, kv_head,
                     num_heads, num_rows, num_splits, active, GROUP: tl.constexpr,
                     HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    """Write the merged outputs of a tile's num_rows rows (row r: token q_start + r // GROUP,
    head kv_head * GROUP + r % GROUP) from their partials (num_splits a row, the first `active`
    of which saw keys), ROWS rows and SPLITS splits a step, each step's partials loaded at once:
    a split at a time cost one memory latency a split (785c2e6 made a Qwen3-0.6B step slower
    so). Loads bypass L1: other SMs wrote them."""
    offs_d = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, SPLITS)
    for r0 in range(0, num_rows, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        row_ok = rows < num_rows
        tokens = q_start + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        first = (tokens * num_heads + heads) * num_splits
        # M_FLOOR, not -inf, for what is masked: a row or split that is none stays finite
        m = tl.full([ROWS], M_FLOOR, tl.float32)
        l_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        for s0 in range(0, active, SPLITS):
            ok = row_ok[:, None] & (s0 + splits < active)[None, :]
            part = first[:, None] + s0 + splits[None, :]  # [ROWS, SPLITS]
            m_s = tl.load(part_ml_ptr + part * 2, mask=ok, other=M_FLOOR, cache_modifier=".cg")
            l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                            mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(m_s, 1))
            alpha = tl.math.exp2(m - m_new)
            w = tl.math.exp2(m_s - m_new[:, None])
            acc = acc * alpha[:, None] + tl.sum(acc_s * w[:, :, None], 1)
            l_sum = l_sum * alpha + tl.sum(l_s * w, 1)
            m = m_new
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = softmax-weighted merge of part_acc[t, h, :] (written in place)."""
    num_tokens, num_heads, num_splits, head_dim = part_acc.shape
    splits_pad = triton.next_power_of_2(num_splits)
    _merge_splits_kernel[(num_tokens, num_heads)](
        part_acc, part_ml, out, num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=splits_pad, **pdl_options(out.device),
        num_warps=4 if splits_pad * head_dim >= 4096 else 2,
    )
