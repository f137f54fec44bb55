"""small_m_linear: a few rows times a weight, against F.linear in float32; with its epilogues
(a folded RMSNorm's 1/rms, SwiGLU, the residual add), against the separate reference ops."""

import pytest
import torch
import torch.nn.functional as F

from echo_kernels.linear import small_m_linear
from echo_kernels.reference import rms_norm_ref, silu_and_mul_ref


@pytest.mark.parametrize("m,n,k,blocks", [(1, 96, 300, (32, 64)), (3, 130, 512, (16, 64)),
                                          (4, 64, 128, (16, 64)), (2, 48, 64, (None, None))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prefetch", [False, True])
def test_matches_linear(device, m, n, k, blocks, dtype, prefetch):
    # ragged N and K (masked tiles), a padded row count (3 -> 4) and the default tiles
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = small_m_linear(x, w, *blocks, prefetch=prefetch)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_rejects_too_many_rows(device):
    with pytest.raises(ValueError, match="1..4 rows"):
        small_m_linear(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device))


def _fused_case(m, n, k, dtype, device, gated):
    torch.manual_seed(1)
    x = (3 * torch.randn(m, k, device=device)).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(2 * n if gated else n, k, device=device) / k**0.5).to(dtype)
    return x, norm_weight, w


def _normed_reference(x, norm_weight, w, gated, eps=1e-6):
    """The separate launches: RMSNorm, the linear rounded to x's dtype, SwiGLU."""
    y = F.linear(rms_norm_ref(x, norm_weight, eps).float(), w.float()).to(x.dtype)
    return silu_and_mul_ref(y) if gated else y.float()


@pytest.mark.parametrize("m,n,k,blocks", [(1, 96, 300, (32, 64)), (3, 40, 256, (16, 64)),
                                          (2, 64, 128, (None, None))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gated_rms_scaled_and_residual(device, m, n, k, blocks, dtype, prefetch):
    # ragged N and K, a padded row count; each epilogue alone and gated with the norm
    x, norm_weight, w = _fused_case(m, n, k, dtype, device, gated=True)
    gated = small_m_linear(x, w, *blocks, prefetch=prefetch, gated=True)
    torch.testing.assert_close(gated.float(), silu_and_mul_ref(F.linear(x.float(), w.float())
                                                                .to(dtype)), atol=3e-3, rtol=3e-3)
    # the norm's weight folded into the linear's: w[n, k] * g[k]
    folded = (w.float() * norm_weight.float()).to(dtype)
    for fused_gate in (False, True):
        weight = folded if fused_gate else folded[:n]
        out = small_m_linear(x, weight, *blocks, prefetch=prefetch, gated=fused_gate,
                             rms_eps=1e-6)
        expected = _normed_reference(x, norm_weight, w if fused_gate else w[:n], fused_gate)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    residual = torch.randn(m, n, device=device).to(dtype)
    out = small_m_linear(x, w[:n], *blocks, prefetch=prefetch, residual=residual)
    # rounded as the model's `residual + linear(x)`: exactly the separate ops
    expected = (small_m_linear(x, w[:n], *blocks, prefetch=prefetch).float()
                + residual.float()).to(dtype)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


def test_rejects_mismatched_fusion_inputs(device):
    x = torch.zeros(1, 64, device=device)
    with pytest.raises(ValueError, match="gate and up"):
        small_m_linear(x, torch.zeros(7, 64, device=device), gated=True)
    with pytest.raises(ValueError, match="residual"):
        small_m_linear(x, torch.zeros(8, 64, device=device), residual=x)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k,block_n,prefetch,warps", [(12288, 4096, 4, False, 4),
                                                        (4096, 4096, 4, True, 2)])
def test_gpu_fused_qwen3_8b_shapes(m, n, k, block_n, prefetch, warps):
    # Qwen3-8B's gate/up (gated) and a qkv-sized GEMV, the norm folded in, in bfloat16
    for gated in (True, False):
        x, norm_weight, w = _fused_case(m, n, k, torch.bfloat16, "cuda", gated)
        folded = (w.float() * norm_weight.float()).to(torch.bfloat16)
        out = small_m_linear(x, folded, block_n, 512, warps, prefetch=prefetch, gated=gated,
                             rms_eps=1e-6)
        expected = _normed_reference(x, norm_weight, w, gated)
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_llama_shapes(m, n, k, prefetch):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(small_m_linear(x, w, prefetch=prefetch).float(),
                               F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
