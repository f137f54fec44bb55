"""flash_attn_varlen against the float32 reference: causal (bottom-right) and not, GQA."""

import pytest
import torch
from kernel_utils import assert_close

from echo_kernels import flash_attn_varlen
from echo_kernels.reference import flash_attn_varlen_ref


def _run(q_lens, k_lens, num_heads, num_kv_heads, head_dim, dtype, causal, device, atol):
    cu_q = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens, device=device).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(sum(k_lens), num_kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    out = flash_attn_varlen(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale, causal)
    ref = flash_attn_varlen_ref(q, k, v, cu_q, cu_k, scale, causal)
    assert_close(out, ref, atol)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (6, 2)])
def test_varlen(device, causal, heads):
    torch.manual_seed(0)
    # equal lengths, seqlen_q < seqlen_k, and seqlen_q > seqlen_k (first rows see no key: zeros)
    _run([5, 40, 20, 12], [5, 40, 37, 7], *heads, 32, torch.float16, causal, device, 3e-3)


def test_varlen_fp32_single_sequence(device):
    torch.manual_seed(1)
    _run([45], [45], 4, 1, 16, torch.float32, True, device, 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(32, 8), (40, 40), (64, 8), (16, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_varlen(heads, head_dim, causal):
    torch.manual_seed(0)
    q_lens = [1, 17, 1000, 2048, 64, 333]
    k_lens = [1, 17, 1000, 2048, 100, 500]
    _run(q_lens, k_lens, *heads, head_dim, torch.bfloat16, causal, "cuda", 2e-2)
