"""silu_and_mul: [..., 2d] -> silu(first half) * second half."""

import pytest
import torch

from echo_kernels import silu_and_mul
from echo_kernels.reference import silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 2 * 48), (2, 3, 2 * 1500)])
def test_silu_and_mul(device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    atol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x), atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [4096, 11008, 12288])
def test_gpu_silu_and_mul(d):
    x = torch.randn(2048, 2 * d, device="cuda", dtype=torch.bfloat16)
    # bf16 output rounded twice (after silu, after the product) against an fp32 reference
    torch.testing.assert_close(silu_and_mul(x).float(), silu_and_mul_ref(x), atol=2e-2,
                               rtol=1.6e-2)
