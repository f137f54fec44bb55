"""Merge of split-KV partial results (the second half of flash decoding).

Each split left an unnormalised output `acc_s`, its running max `m_s` (log2 units) and sum `l_s`;
the exact result is sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s with m = max_s m_s. A split
that saw no key of a row holds m_s = M_FLOOR, l_s = 0 and drops out with weight 0; its acc_s
is not read (a split with no key of its context at all does not write it).
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
    # only the splits that saw a key: an empty one's output is zero or never written
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=(split_ok & (m > M_FLOOR))[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """out[t, h] = softmax-weighted merge of part_acc[t, h, :] (written in place)."""
    num_tokens, num_heads, num_splits, head_dim = part_acc.shape
    splits_pad = triton.next_power_of_2(num_splits)
    _merge_splits_kernel[(num_tokens, num_heads)](
        part_acc, part_ml, out, num_heads, num_splits, out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=splits_pad, **pdl_options(out.device),
        num_warps=4 if splits_pad * head_dim >= 4096 else 2,
    )
