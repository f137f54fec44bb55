"""store_kv_cache: slots, slot -1, strided inputs, int8 quantisation with per-token-head scales."""

import pytest
import torch

from echo_kernels import store_kv_cache
from echo_kernels.reference import quantize_int8, store_kv_cache_ref


def _inputs(num_tokens, num_kv_heads, head_dim, block_size, num_blocks, dtype, device):
    # k and v as views into a fused qkv projection (token stride > num_kv_heads * head_dim)
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim]
    v = qkv[:, 2 * num_kv_heads * head_dim:]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::3] = -1
    return k, v, slots


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store(device, dtype, slot_dtype):
    torch.manual_seed(0)
    k, v, slots = _inputs(10, 3, 32, 16, 4, dtype, device)
    shape = (4, 16, 3, 32)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_cache(k, v, k_cache, v_cache, slots.to(slot_dtype))
    store_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert k_cache.isnan().sum() == k_cache.numel() - 6 * 3 * 32  # 4 of 10 tokens skipped


def test_store_int8(device):
    torch.manual_seed(0)
    k, v, slots = _inputs(10, 2, 32, 16, 4, torch.float16, device)
    k[1] = 0.0  # an all-zero row: scale 0, values 0
    shape = (4, 16, 2, 32)
    caches = [torch.zeros(shape, dtype=torch.int8, device=device) for _ in range(2)]
    scales = [torch.full(shape[:3], float("nan"), device=device) for _ in range(2)]
    refs = [c.clone() for c in caches] + [s.clone() for s in scales]
    store_kv_cache(k, v, *caches, slots, *scales)
    store_kv_cache_ref(k, v, *refs[:2], slots, *refs[2:])
    for got, want in zip(caches + scales, refs, strict=True):
        diff = (got.float() - want.float()).nan_to_num(0.0).abs().max().item()
        assert diff <= (1.0 if got.dtype == torch.int8 else 1e-6)
        assert torch.equal(got.float().isnan(), want.float().isnan())
    # dequantised values are within half a step of the input
    keep = slots >= 0
    blocks, offsets = slots[keep] // 16, slots[keep] % 16
    deq = caches[0][blocks, offsets].float() * scales[0][blocks, offsets].unsqueeze(-1)
    step = scales[0][blocks, offsets].unsqueeze(-1)
    assert ((deq - k[keep].float()).abs() <= 0.5 * step + 1e-3).all()


def test_quantize_int8_reference():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    values, scale = quantize_int8(x)
    assert scale.tolist() == pytest.approx([2.0 / 127, 0.0])
    assert values.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_gpu_store(kv_dtype):
    torch.manual_seed(0)
    k, v, slots = _inputs(4096, 8, 128, 16, 4096, torch.bfloat16, "cuda")
    shape = (4096, 16, 8, 128)
    caches = [torch.zeros(shape, dtype=kv_dtype, device="cuda") for _ in range(2)]
    scales = [torch.zeros(shape[:3], device="cuda") for _ in range(2)] if kv_dtype == torch.int8 \
        else [None, None]
    refs = [c.clone() for c in caches] + [s.clone() if s is not None else None for s in scales]
    store_kv_cache(k, v, *caches, slots, *scales)
    store_kv_cache_ref(k, v, *refs[:2], slots, *refs[2:])
    for got, want in zip(caches, refs[:2], strict=True):
        assert (got.float() - want.float()).abs().max().item() <= (1.0 if kv_dtype == torch.int8
                                                                   else 0.0)
