"""SwiGLU: silu(gate) * up over a fused [..., 2d] input -> [..., d]."""

import torch
import triton
import triton.language as tl

from echo_kernels.l2_prefetch import L2Prefetch, launch_args, prefetch_if_spare
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate, then up
    out_ptr,  # [num_rows, d]
    d,
    stride_x,
    stride_o,
    pf_ptr,  # echo_kernels.l2_prefetch: programs from num_rows on prefetch (PREFETCH)
    pf_bytes,
    num_rows,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if PREFETCH:
        if prefetch_if_spare(pf_ptr, pf_bytes, num_rows):
            return
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # rounded to the input dtype between the two ops, as F.silu(gate) * up would be
    act = (g / (1.0 + tl.math.exp2(-g * 1.4426950408889634))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, prefetch: L2Prefetch | None = None) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new [..., d] tensor. With `prefetch`,
    spare programs ask the L2 for the start of the next weight."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(1) == 1
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    rows = x2.shape[0]
    pf_ptr, pf_bytes, spare = launch_args(prefetch, x2)
    if rows:
        _silu_and_mul_kernel[(rows + spare, triton.cdiv(d, block))](
            x2, out.view(-1, d), d, x2.stride(0), d, pf_ptr, pf_bytes, rows, BLOCK=block,
            PREFETCH=spare > 0, **pdl_options(x.device), num_warps=max(1, min(4, block // 256)),
        )
    return out
