"""SwiGLU: silu(gate) * up over a fused [..., 2d] input -> [..., d]."""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate, then up
    out_ptr,  # [num_rows, d]
    d,
    stride_x,
    stride_o,
    rms_ptr,  # [num_rows, hidden] (RMS_SCALE): the rows whose 1/rms scales gate and up
    hidden,
    stride_rms,
    eps,
    BLOCK: tl.constexpr,
    RMS_SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # hidden rounded up to a power of two
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    if RMS_SCALE:
        # gate/up ran on the un-normalised row, with the norm's weight folded into theirs
        offs_h = tl.arange(0, BLOCK_H)
        h = tl.load(rms_ptr + row * stride_rms + offs_h, mask=offs_h < hidden,
                    other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(h * h, 0) / hidden + eps)
        gate = (gate.to(tl.float32) * rstd).to(gate.dtype)
        up = (up.to(tl.float32) * rstd).to(up.dtype)
    g = gate.to(tl.float32)
    # rounded to the input dtype between the two ops, as F.silu(gate) * up would be
    act = (g / (1.0 + tl.math.exp2(-g * 1.4426950408889634))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, rms_of: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """x [..., 2d] -> silu(x[..., :d]) * x[..., d:], a new [..., d] tensor.

    rms_of [..., hidden]: gate and up are first scaled by rsqrt(mean(rms_of^2) + eps) of their
    row, which makes x = gate_up(rms_of) the gate/up of rms_norm(rms_of) when the norm's weight
    is folded into gate_up's.
    """
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    assert x2.stride(1) == 1
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    rms = x2 if rms_of is None else rms_of.reshape(-1, rms_of.shape[-1])
    assert rms.shape[0] == x2.shape[0] and rms.stride(-1) == 1
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out.view(-1, d), d, x2.stride(0), d, rms, rms.shape[1], rms.stride(0), eps,
            BLOCK=block, RMS_SCALE=rms_of is not None,
            BLOCK_H=triton.next_power_of_2(rms.shape[1]), **pdl_options(x.device),
            num_warps=max(1, min(4, block // 256)),
        )
    return out
