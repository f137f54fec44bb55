"""small_m_linear: a few rows times a weight, against F.linear in float32."""

import pytest
import torch
import torch.nn.functional as F

from echo_kernels.linear import small_m_linear


@pytest.mark.parametrize("m,n,k,split_k", [(1, 96, 300, None), (5, 130, 512, 3), (16, 64, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_linear(device, m, n, k, split_k, dtype):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = small_m_linear(x, w, split_k=split_k, block_n=32, block_k=64)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = F.linear(x.float(), w.float())
    # tl.dot on fp32 inputs may use tf32 on the GPU
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_llama_shapes(m, n, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(small_m_linear(x, w).float(), F.linear(x.float(), w.float()),
                               atol=2e-2, rtol=2e-2)
