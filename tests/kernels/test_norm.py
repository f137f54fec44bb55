"""rms_norm and fused_add_rms_norm (in place: x <- normalised, residual <- x + residual)."""

import pytest
import torch

from echo_kernels import fused_add_rms_norm, rms_norm
from echo_kernels.reference import fused_add_rms_norm_ref, rms_norm_ref

ATOL = {torch.float16: 2e-3, torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 100), (2, 3, 64)])
def test_rms_norm(device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype)
    w = torch.randn(shape[-1], device=device).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), rms_norm_ref(x, w, 1e-6).float(), atol=ATOL[dtype],
                               rtol=0)


def test_rms_norm_strided_rows(device):
    x = torch.randn(6, 2 * 48, device=device).to(torch.float16)[:, :48]  # row stride 96
    w = torch.randn(48, device=device).to(torch.float16)
    torch.testing.assert_close(rms_norm(x, w, 1e-5).float(), rms_norm_ref(x, w, 1e-5).float(),
                               atol=2e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_add_rms_norm(device, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 96, device=device).to(dtype)
    residual = torch.randn(7, 96, device=device).to(dtype)
    w = torch.randn(96, device=device).to(dtype)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    x_in, res_in = x.clone(), residual.clone()
    out, res = fused_add_rms_norm(x_in, res_in, w, 1e-6)
    assert out.data_ptr() == x_in.data_ptr() and res.data_ptr() == res_in.data_ptr()
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), want_out.float(), atol=ATOL[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_gpu_norms(hidden):
    torch.manual_seed(0)
    x = torch.randn(8192, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    # same rounding points as the reference; rsqrt and summation order may move one bf16 ulp
    tol = dict(atol=ATOL[torch.bfloat16], rtol=1e-2)
    torch.testing.assert_close(rms_norm(x, w, 1e-6).float(), rms_norm_ref(x, w, 1e-6).float(),
                               **tol)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    out, res = fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(out.float(), want_out.float(), **tol)
