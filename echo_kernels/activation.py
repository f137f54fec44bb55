"""SwiGLU: silu(gate) * up over a fused [..., 2d] input -> [..., d]."""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in float32, gate and up in the output dtype: silu's result is rounded to
    that dtype before the product, as F.silu(gate) * up rounds it (also the fused kernels')."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.math.exp2(-g * 1.4426950408889634))).to(gate.dtype)
    return act.to(tl.float32) * up.to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate, then up
    out_ptr,  # [num_rows, d]
    d,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    out = silu_times(gate, up)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new [..., d] tensor."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(1) == 1
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out.view(-1, d), d, x2.stride(0), d, BLOCK=block, **pdl_options(x.device),
            num_warps=max(1, min(4, block // 256)),
        )
    return out
