"""RMSNorm, alone and fused with the residual add before it (one row per program).

Rounding follows Hugging Face's LlamaRMSNorm/Qwen3RMSNorm: statistics in float32, the normalised
row cast to the input dtype, then multiplied by the weight and rounded again; the residual sum is
rounded to the input dtype before it is normalised, as the model's `residual + x` would be.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def apply_rms(
    x,  # [..., BLOCK] float32
    rstd,  # [...] float32, rsqrt(mean(x^2) + eps) of each row
    w,  # [BLOCK] weight
    OUT_DTYPE: tl.constexpr,
):
    """(x * rstd).to(OUT_DTYPE) * w, rounded to OUT_DTYPE (Hugging Face's rounding points)."""
    y = (x * tl.expand_dims(rstd, -1)).to(OUT_DTYPE).to(tl.float32)
    return (y * w.to(tl.float32)).to(OUT_DTYPE)


@triton.jit
def add_rms_norm_row(
    x,  # [BLOCK] one row, in the output dtype
    residual_ptr,  # the row's residual: read, then overwritten with x + residual
    w_ptr,
    out_ptr,  # where the row's rms_norm(x + residual) goes
    cols,
    mask,
    n_cols,
    eps,
):
    """fused_add_rms_norm of one row (also the tail of the fused all-reduce)."""
    r = tl.load(residual_ptr + cols, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(residual_ptr + cols, s, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    sf = s.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(sf * sf, 0) / n_cols + eps)
    tl.store(out_ptr + cols, apply_rms(sf, rstd, w, x.dtype), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, n_cols]
    w_ptr,  # [n_cols]
    out_ptr,  # [num_rows, n_cols]
    n_cols,
    eps,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    rstd = tl.math.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = apply_rms(x, rstd, w, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,  # [num_rows, n_cols]: input, overwritten with the normalised output
    residual_ptr,  # [num_rows, n_cols]: input, overwritten with x + residual
    w_ptr,  # [n_cols]
    n_cols,
    eps,
    stride_x,
    stride_r,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_rms_norm_row(x, residual_ptr + row * stride_r, w_ptr, x_ptr + row * stride_x, cols, mask,
                     n_cols, eps)


def _rows(t: torch.Tensor) -> torch.Tensor:
    assert t.stride(-1) == 1, "the normalised dimension must be contiguous"
    return t.view(-1, t.shape[-1])


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., hidden] -> new tensor of x's shape and dtype."""
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n_cols)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out.view(-1, n_cols), n_cols, eps,
                                         x2.stride(0), n_cols, BLOCK=block,
                                         **pdl_options(x.device), num_warps=_num_warps(block))
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; x = rms_norm(residual). Both in place; returns (x, residual).

    x and residual are [..., hidden] of one dtype; each row is read once and written once.
    """
    assert x.shape == residual.shape and x.dtype == residual.dtype
    x2, r2 = _rows(x), _rows(residual)
    n_cols = x.shape[-1]
    block = triton.next_power_of_2(n_cols)
    if x2.shape[0]:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, n_cols, eps, x2.stride(0),
                                                   r2.stride(0), BLOCK=block,
                                                   **pdl_options(x.device),
                                                   num_warps=_num_warps(block))
    return x, residual
