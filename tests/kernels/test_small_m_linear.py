"""small_m_linear: a few rows times a weight, against F.linear in float32."""

import pytest
import torch
import torch.nn.functional as F

from echo_kernels.linear import small_m_linear


# the last three: one tile over the whole of K (with prefetch, all loaded before the wait),
# ragged K, ragged N, even
@pytest.mark.parametrize("m,n,k,blocks", [(1, 96, 300, (32, 64)), (3, 130, 512, (16, 64)),
                                          (4, 64, 128, (16, 64)), (2, 48, 64, (None, None)),
                                          (1, 96, 300, (8, 512)), (3, 130, 512, (4, 512)),
                                          (2, 64, 256, (8, 256))])
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


@pytest.mark.parametrize("m,d,k,blocks,prefetch", [
    (1, 48, 300, (8, 64), False),  # ragged outputs (48 = 12 programs of 4) and K
    (3, 24, 128, (16, 64), True),  # ragged: 24 outputs over blocks of 8
    (2, 32, 64, (8, 64), True),  # even, one tile over the whole of K
    (4, 10, 96, (4, 128), True)])  # padded K in one tile
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_matches_the_separate_launches(device, m, d, k, blocks, prefetch, dtype):
    # [gate; up] rows -> silu(gate) * up, rounded as F.linear then F.silu(gate) * up round it
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(2 * d, k, device=device) / k**0.5).to(dtype)
    out = small_m_linear(x, w, *blocks, prefetch=prefetch, swiglu=True)
    gate, up = F.linear(x.float(), w.float()).to(dtype).chunk(2, dim=-1)
    expected = (F.silu(gate.float()).to(dtype).float() * up.float()).to(dtype)
    assert out.shape == (m, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)


def test_swiglu_rejects_an_odd_weight(device):
    with pytest.raises(ValueError, match="gate and up"):
        small_m_linear(torch.zeros(1, 64, device=device), torch.zeros(9, 64, device=device),
                       swiglu=True)


def test_rejects_too_many_rows(device):
    with pytest.raises(ValueError, match="1..4 rows"):
        small_m_linear(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (1024, 3072), (2304, 768),
                                 (5120, 2048), (2048, 4096)])
def test_gpu_whole_k_tiles_at_small_model_shapes(n, k):
    # Qwen3-0.6B's qkv, o_proj and down, stories110M's qkv, Qwen3-30B-A3B's qkv and o_proj,
    # through every tile the tuning offers that loads a program's whole share before the wait
    from echo.worker.linear_tuning import preload_tiles

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    tiles = preload_tiles(k)
    assert tiles
    for block_n, block_k, prefetch, warps in tiles:
        out = small_m_linear(x, w, block_n, block_k, warps, prefetch=prefetch)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 1024), (4096, 768), (28672, 4096)])
def test_gpu_swiglu_at_gate_up_shapes(n, k):
    # Qwen3-0.6B's, stories110M's and Llama-3.1-8B's gate/up, through the tiles the tuning
    # offers with SwiGLU inside, against the matmul and silu_and_mul's launch
    from echo.worker.linear_tuning import gemv_candidates
    from echo_kernels import silu_and_mul

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    expected = silu_and_mul(F.linear(x.float(), w.float()).to(torch.bfloat16)).float()
    for block_n, block_k, prefetch, warps in gemv_candidates(k):
        out = small_m_linear(x, w, block_n, block_k, warps, prefetch=prefetch, swiglu=True)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_llama_shapes(m, n, k, prefetch):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(small_m_linear(x, w, prefetch=prefetch).float(),
                               F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
