"""small_m_linear: a few rows times a weight, against F.linear in float32."""

import pytest
import torch
import torch.nn.functional as F

from echo_kernels.linear import small_m_linear


# preload: the weight columns loaded before the PDL wait when the case preloads
@pytest.mark.parametrize("m,n,k,blocks,preload", [
    (1, 96, 300, (32, 64), 128), (3, 130, 512, (16, 64), 256), (4, 64, 128, (16, 64), 128),
    (2, 48, 64, (None, None), 256)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("prefetch,preloads", [(False, False), (True, False), (False, True),
                                               (True, True)])
def test_matches_linear(device, m, n, k, blocks, preload, dtype, prefetch, preloads):
    # ragged N and K (masked tiles), a padded row count (3 -> 4), the default tiles, and
    # preloads shorter than K, equal to it and longer (the default tiles' 256 > 64)
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    out = small_m_linear(x, w, *blocks, prefetch=prefetch, preload_k=preload if preloads else 0)
    assert out.shape == (m, n) and out.dtype == dtype
    expected = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)


def test_rejects_too_many_rows(device):
    with pytest.raises(ValueError, match="1..4 rows"):
        small_m_linear(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device))
    for preload in (96, 64):  # not a power of two; not a multiple of the 128-column tile
        with pytest.raises(ValueError, match="preload_k"):
            small_m_linear(torch.zeros(1, 64, device=device), torch.zeros(8, 64, device=device),
                           16, 128, preload_k=preload)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("prefetch,preload", [(False, 0), (True, 0), (False, 2048), (True, 1024)])
def test_gpu_llama_shapes(m, n, k, prefetch, preload):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    out = small_m_linear(x, w, prefetch=prefetch, preload_k=preload)
    torch.testing.assert_close(out.float(),
                               F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
