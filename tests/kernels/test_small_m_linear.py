"""small_m_linear: a few rows times a weight, against F.linear in float32."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from echo_kernels.linear import small_m_linear, small_m_normed_linear
from echo_kernels.reference import rms_norm_ref


def linear_ref(x: torch.Tensor, w: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """F.linear in float32 rounded to x's dtype; swiglu: silu(gate) * up of its halves, rounded
    as F.silu(gate) * up rounds them."""
    y = F.linear(x.float(), w.float()).to(x.dtype)
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)
    return y


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
    (4, 10, 96, (4, 128), True),  # padded K in one tile
    (1, 6, 64, (2, 64), True)])  # one gate and up pair a program, over the whole of K
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swiglu_matches_the_separate_launches(device, m, d, k, blocks, prefetch, dtype):
    # [gate; up] rows -> silu(gate) * up, rounded as F.linear then F.silu(gate) * up round it
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(2 * d, k, device=device) / k**0.5).to(dtype)
    out = small_m_linear(x, w, *blocks, prefetch=prefetch, swiglu=True)
    expected = linear_ref(x, w, swiglu=True)
    assert out.shape == (m, d) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)


def test_swiglu_rejects_an_odd_weight(device):
    with pytest.raises(ValueError, match="gate and up"):
        small_m_linear(torch.zeros(1, 64, device=device), torch.zeros(9, 64, device=device),
                       swiglu=True)


@pytest.mark.parametrize("m,n,k,block_n,swiglu", [
    (1, 64, 256, 8, False),  # even
    (3, 40, 96, 4, False),  # ragged N, K padded to 128
    (2, 48, 128, 8, True),  # gate and up, SwiGLU inside
    (1, 12, 64, 2, True),  # one pair a program (a 2-warp whole-K tile at K = 2048)
])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("programs_per_sm", [None, 1, 3])  # a block a program; runs of blocks
def test_normed_matches_the_norm_then_the_linear(device, m, n, k, block_n, swiglu,
                                                 with_residual, dtype, programs_per_sm):
    # with runs of blocks (2 stand-in SMs on the CPU): 2 or 6 programs over 6-12 blocks, the
    # last run ragged or past N
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    residual = torch.randn(m, k, device=device).to(dtype) if with_residual else None
    norm_w = (1 + torch.randn(k, device=device) / 4).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    normed_out = torch.empty_like(x)  # the normed rows too, as a router stores them
    out, total = small_m_normed_linear(x, residual, norm_w, 1e-6, w, block_n, swiglu=swiglu,
                                       normed_out=normed_out, programs_per_sm=programs_per_sm)
    want_total = x if residual is None else (x.float() + residual.float()).to(dtype)
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)
    normed = rms_norm_ref(want_total, norm_w, 1e-6)
    torch.testing.assert_close(normed_out, normed, atol=1e-3, rtol=1e-3)
    y = linear_ref(normed, w, swiglu)
    assert out.shape == y.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), y.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("m,n,k,block_n,swiglu", [
    (1, 64, 256, 8, False),  # even
    (3, 40, 96, 4, False),  # ragged N, K padded to 128
    (2, 48, 128, 8, True),  # gate and up, SwiGLU inside
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("programs_per_sm", [1, 3])
def test_runs_of_blocks_match_the_linear(device, m, n, k, block_n, swiglu, dtype,
                                         programs_per_sm):
    # no norm: a program's run of blocks (2 stand-in SMs on the CPU: 2 or 6 programs over
    # 5-10 blocks, the last run ragged or past N), x loaded once
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    block_k = 1 << (k - 1).bit_length()
    out = small_m_linear(x, w, block_n, block_k, prefetch=True, swiglu=swiglu,
                         programs_per_sm=programs_per_sm)
    y = linear_ref(x, w, swiglu)
    assert out.shape == y.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), y.float(), atol=2e-3, rtol=2e-3)


def test_runs_of_blocks_need_a_tile_over_the_whole_of_k(device):
    with pytest.raises(ValueError, match="programs_per_sm takes a tile over the whole of K"):
        small_m_linear(torch.zeros(1, 256, device=device), torch.zeros(8, 256, device=device),
                       8, 128, prefetch=True, programs_per_sm=2)


def test_rejects_too_many_rows(device):
    with pytest.raises(ValueError, match="1..4 rows"):
        small_m_linear(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (1024, 3072), (2304, 768),
                                 (5120, 2048), (2048, 4096)])
def test_gpu_whole_k_tiles_at_small_model_shapes(n, k):
    # Qwen3-0.6B's qkv, o_proj and down, stories110M's qkv, Qwen3-30B-A3B's qkv and o_proj,
    # through every tile the tuning offers that loads a program's whole share before the wait
    # (a block a program, and runs of blocks)
    from echo.worker.linear_tuning import RUN_PROGRAMS, preload_tiles

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    tiles = preload_tiles(k)
    assert tiles
    for (block_n, block_k, prefetch, warps), programs in itertools.product(
            tiles, (None, *RUN_PROGRAMS)):
        out = small_m_linear(x, w, block_n, block_k, warps, prefetch=prefetch,
                             programs_per_sm=programs)
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
@pytest.mark.parametrize("n,k,swiglu", [(4096, 1024, False), (6144, 1024, True),
                                        (6144, 4096, False), (28672, 4096, True),
                                        (128, 2048, False)])
def test_gpu_normed_at_model_shapes(n, k, swiglu):
    # Qwen3-0.6B's and Llama-3.1-8B's qkv and gate/up, Qwen3-30B-A3B's router (which stores
    # the normed row for the experts too), with the norm before them inside, through every
    # tile over the whole of K the tuning offers (a block a program, and runs of blocks),
    # against the two launches
    from echo.worker.linear_tuning import RUN_PROGRAMS, preload_tiles
    from echo_kernels import fused_add_rms_norm, silu_and_mul

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    norm_w = 1 + torch.randn(k, device="cuda", dtype=torch.bfloat16) / 4
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    normed, total = fused_add_rms_norm(x.clone(), residual.clone(), norm_w, 1e-6)
    expected = F.linear(normed.float(), w.float()).to(torch.bfloat16)
    if swiglu:
        expected = silu_and_mul(expected)
    for (block_n, _, _, warps), programs in itertools.product(preload_tiles(k),
                                                              (None, *RUN_PROGRAMS)):
        normed_out = torch.empty_like(x)
        out, got_total = small_m_normed_linear(x, residual, norm_w, 1e-6, w, block_n, warps,
                                               swiglu=swiglu, normed_out=normed_out,
                                               programs_per_sm=programs)
        torch.testing.assert_close(got_total, total, atol=0, rtol=0)
        # the same rounding points; the sum of squares may round apart in its last bit
        torch.testing.assert_close(normed_out, normed, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_llama_shapes(m, n, k, prefetch):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(small_m_linear(x, w, prefetch=prefetch).float(),
                               F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)
