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


def _check_with_cache(kv_dtype, is_neox, norm, device, num_tokens=7, heads=(4, 2), head_dim=32,
                      dtype=torch.float16):
    """rotary_embedding writing the cache too, against the two launches it replaces
    (bit-exact) and against the float32 references."""
    from echo_kernels import store_kv_cache
    from echo_kernels.reference import store_kv_cache_ref

    torch.manual_seed(1)
    num_heads, num_kv_heads = heads
    block_size, num_blocks = 16, 4
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    cos_sin = _cos_sin(4096, head_dim, device)
    q_w = torch.rand(head_dim, device=device).to(dtype) + 0.5 if norm else None
    k_w = torch.rand(head_dim, device=device).to(dtype) + 0.5 if norm else None
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[2] = -1  # a padded token: rotated, never stored

    def caches():
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cache_dtype = torch.int8 if kv_dtype == torch.int8 else dtype
        kc, vc = (torch.full(shape, 7, device=device).to(cache_dtype) for _ in range(2))
        scales = [torch.full(shape[:3], 7.0, device=device) for _ in range(2)]
        return kc, vc, *(scales if kv_dtype == torch.int8 else [None, None])

    fused = caches()
    qf, kf = q.clone(), k.clone()
    rotary_embedding(positions, qf, kf, cos_sin, is_neox, q_w, k_w, 1e-6, v=v, k_cache=fused[0],
                     v_cache=fused[1], slot_mapping=slots, k_scale=fused[2], v_scale=fused[3])
    separate = caches()
    qs, ks = q.clone(), k.clone()
    rotary_embedding(positions, qs, ks, cos_sin, is_neox, q_w, k_w, 1e-6)
    store_kv_cache(ks, v, separate[0], separate[1], slots, separate[2], separate[3])
    assert torch.equal(qf, qs) and torch.equal(kf, ks)
    for got, want in zip(fused, separate):
        if got is not None:
            assert torch.equal(got, want)

    want_q, want_k = rotary_embedding_ref(positions, q, k, cos_sin, is_neox, q_w, k_w, 1e-6)
    atol = 8e-3 if dtype == torch.float16 else 5e-2  # bf16: an ulp at 2-4 is 1.6e-2
    torch.testing.assert_close(qf.float(), want_q, atol=atol, rtol=0)
    reference = caches()
    store_kv_cache_ref(want_k.to(dtype), v, *reference[:2], slots, *reference[2:])
    if kv_dtype == torch.int8:
        # a one-ulp difference in a rotated element, or the GPU's fused multiply-adds in the
        # quantiser, may move a value's rounding by one step
        for got, want in zip(fused[:2], reference[:2]):
            assert (got.int() - want.int()).abs().max() <= 1
        for got, want in zip(fused[2:], reference[2:]):
            torch.testing.assert_close(got, want, rtol=2e-3, atol=0)
    else:
        torch.testing.assert_close(fused[0].float(), reference[0].float(), atol=atol, rtol=0)
        assert torch.equal(fused[1], reference[1])


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.int8])
@pytest.mark.parametrize("is_neox,norm", [(True, False), (False, False), (True, True)])
def test_rope_writes_kv_cache(device, kv_dtype, is_neox, norm):
    _check_with_cache(kv_dtype, is_neox, norm, device)


def test_rope_writes_kv_cache_head_chunks(device):
    # with the norm, a token's heads span two programs; one program has no key heads
    _check_with_cache(torch.int8, True, True, device, heads=(16, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_rope_writes_kv_cache(kv_dtype, norm):
    _check_with_cache(kv_dtype, True, norm, "cuda", num_tokens=64, heads=(32, 8),
                      head_dim=128, dtype=torch.bfloat16)
