"""small_m_linear: a few rows times a weight, against F.linear in float32."""

import pytest
import torch
import torch.nn.functional as F
import triton

from echo_kernels.linear import small_m_linear


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


@pytest.mark.parametrize("m,n,k,block_k,split_k", [
    (1, 96, 300, 64, 3),  # ragged K: 5 tiles as 2 + 2 + 1, the last one masked
    (3, 130, 512, 64, 4),  # ragged N, padded rows
    (2, 64, 128, 64, 8),  # more splits asked than tiles: 2 splits of one tile
])
@pytest.mark.parametrize("prefetch", [False, True])
def test_split_k_matches_linear_and_leaves_the_counts_zero(device, m, n, k, block_k, split_k,
                                                           prefetch):
    torch.manual_seed(0)
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device) / k**0.5
    arrivals = torch.zeros(triton.cdiv(n, 16), dtype=torch.int32, device=device)
    first = small_m_linear(x, w, 16, block_k, prefetch=prefetch, split_k=split_k,
                           arrivals=arrivals)
    torch.testing.assert_close(first, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert not arrivals.any()  # each block's last split reset its count
    # the same counts again: the same sums in the same order, bit for bit
    again = small_m_linear(x, w, 16, block_k, prefetch=prefetch, split_k=split_k,
                           arrivals=arrivals)
    assert torch.equal(first, again)


def test_split_k_needs_its_counts(device):
    x, w = torch.zeros(1, 256, device=device), torch.zeros(32, 256, device=device)
    with pytest.raises(ValueError, match="arrivals: split_k > 1 needs 2 zeroed int32"):
        small_m_linear(x, w, 16, 64, split_k=2)
    with pytest.raises(ValueError, match="arrivals"):
        small_m_linear(x, w, 16, 64, split_k=2, arrivals=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="split_k: must be >= 1"):
        small_m_linear(x, w, 16, 64, split_k=0)
    # one tile of K: a single split, no counts needed
    torch.testing.assert_close(small_m_linear(x, w, 16, 256, split_k=4), F.linear(x, w))


def test_rejects_too_many_rows(device):
    with pytest.raises(ValueError, match="1..4 rows"):
        small_m_linear(torch.zeros(5, 64, device=device), torch.zeros(8, 64, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("prefetch", [False, True])
def test_gpu_llama_shapes(m, n, k, prefetch):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    torch.testing.assert_close(small_m_linear(x, w, prefetch=prefetch).float(),
                               F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (2048, 4096)])
@pytest.mark.parametrize("split_k", [2, 4])
def test_gpu_split_k_in_a_replayed_graph(n, k, split_k):
    # Qwen3-0.6B's o_proj and down, Qwen3-30B-A3B's o_proj: the counts must be zero again
    # after every call for the graph's next replay (and for the layer after in the same graph)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(3)]
    arrivals = torch.zeros(n // 8, dtype=torch.int32, device="cuda")

    def run():
        return [small_m_linear(x, w, 8, 512, split_k=split_k, arrivals=arrivals)
                for w in weights]

    run()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for out, w in zip(outs, weights):
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()),
                                   atol=2e-2, rtol=2e-2)
    assert not arrivals.any()
