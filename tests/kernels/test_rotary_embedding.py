"""rotary_embedding in place on q/k views, neox and GPT-J styles, with and without q/k norm."""

import pytest
import torch

from echo_kernels import rotary_embedding
from echo_kernels.reference import rotary_embedding_ref


def _cos_sin(max_pos, head_dim, device):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(max_pos, device=device).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), -1)


def _check(num_tokens, num_heads, num_kv_heads, head_dim, dtype, is_neox, norm, device, atol):
    torch.manual_seed(0)
    # q and k as views into a fused qkv projection output
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, device=device).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    cos_sin = _cos_sin(4096, head_dim, device)
    q_w = torch.rand(head_dim, device=device).to(dtype) + 0.5 if norm else None
    k_w = torch.rand(head_dim, device=device).to(dtype) + 0.5 if norm else None
    want_q, want_k = rotary_embedding_ref(positions, q, k, cos_sin, is_neox, q_w, k_w, 1e-6)
    rotary_embedding(positions, q, k, cos_sin, is_neox, q_w, k_w, 1e-6)
    torch.testing.assert_close(q.float(), want_q, atol=atol, rtol=0)
    torch.testing.assert_close(k.float(), want_k, atol=atol, rtol=0)
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rope(device, is_neox, norm, dtype):
    atol = 1e-5 if dtype == torch.float32 else 8e-3
    _check(9, 6, 2, 32, dtype, is_neox, norm, device, atol)


@pytest.mark.parametrize("heads", [(16, 1), (5, 5)])
def test_rope_head_chunks(device, heads):
    # with the norm, heads are split over programs: uneven chunks, chunks without key heads
    _check(3, *heads, 16, torch.float32, True, True, device, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (40, 8), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_rope(heads, head_dim, norm):
    _check(4096, *heads, head_dim, torch.bfloat16, True, norm, "cuda", 5e-2)
