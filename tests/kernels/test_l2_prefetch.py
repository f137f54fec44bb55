"""Short kernels with spare programs that prefetch the next weight into the L2
(echo_kernels.l2_prefetch): the spare programs change nothing the kernel computes.

On the CPU the interpreter skips the prefetch instruction itself but runs the spare programs'
early exit; on the GPU (gpu marker) the real prefetches run over a weight larger than the L2.
"""

import pytest
import torch

from echo_kernels import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul
from echo_kernels.l2_prefetch import MAX_ROWS, L2Prefetch
from echo_kernels.reference import fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref


def rope_and_store(x, prefetch):
    """Qwen3-style RoPE with q/k norm and the int8 KV-cache write, on 3 tokens of 4/2 heads."""
    device, dtype = x.device, x.dtype
    q = x[:, :64].reshape(3, 4, 16).clone()
    k = x[:, 64:96].reshape(3, 2, 16).clone()
    v = k.flip(-1).clone()
    cos_sin = torch.cat([torch.cos(torch.arange(32.0)[:, None] / torch.arange(1.0, 9.0)),
                         torch.sin(torch.arange(32.0)[:, None] / torch.arange(1.0, 9.0))],
                        1).to(device)
    caches = [torch.zeros(2, 4, 2, 16, dtype=torch.int8, device=device) for _ in range(2)]
    scales = [torch.zeros(2, 4, 2, device=device) for _ in range(2)]
    rotary_embedding(torch.tensor([3, 9, 30], device=device), q, k, cos_sin, True,
                     torch.ones(16, dtype=dtype, device=device),
                     torch.ones(16, dtype=dtype, device=device), 1e-6, v=v, k_cache=caches[0],
                     v_cache=caches[1], slot_mapping=torch.tensor([0, 5, 7], device=device),
                     k_scale=scales[0], v_scale=scales[1], prefetch=prefetch)
    return q, k, *caches, *scales


def run_all(x, residual, gate_up, w, prefetch):
    """Every short kernel that takes a prefetch, on copies of the inputs."""
    out = {"rms_norm": rms_norm(x, w, 1e-6, prefetch)}
    out["fused_add_rms_norm"] = fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6,
                                                   prefetch)
    out["silu_and_mul"] = silu_and_mul(gate_up, prefetch)
    out["rotary_embedding"] = rope_and_store(x, prefetch)
    return out


def check_unchanged(device, dtype, weight_numel, prefetch_bytes):
    torch.manual_seed(0)
    rows, hidden = 3, 96
    x, residual = (torch.randn(rows, hidden, device=device, dtype=dtype) for _ in range(2))
    gate_up = torch.randn(rows, 2 * 80, device=device, dtype=dtype)
    w = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    next_weight = torch.randn(weight_numel, device=device, dtype=dtype)
    before = next_weight.clone()
    plain = run_all(x, residual, gate_up, w, None)
    fetched = run_all(x, residual, gate_up, w, L2Prefetch(next_weight, prefetch_bytes))
    # bit for bit: the spare programs neither compute rows nor write anything
    assert torch.equal(fetched["rms_norm"], plain["rms_norm"])
    assert all(torch.equal(a, b) for a, b in zip(fetched["fused_add_rms_norm"],
                                                 plain["fused_add_rms_norm"], strict=True))
    assert torch.equal(fetched["silu_and_mul"], plain["silu_and_mul"])
    assert all(torch.equal(a, b) for a, b in zip(fetched["rotary_embedding"],
                                                 plain["rotary_embedding"], strict=True))
    assert plain["rotary_embedding"][2].abs().sum() > 0  # the cache was written
    assert torch.equal(next_weight, before)
    # and the kernels still compute what the references do
    tol = dict(atol=2e-2 if dtype == torch.bfloat16 else 2e-3, rtol=0)
    torch.testing.assert_close(plain["rms_norm"].float(), rms_norm_ref(x, w, 1e-6).float(),
                               **tol)
    want_out, want_res = fused_add_rms_norm_ref(x, residual, w, 1e-6)
    torch.testing.assert_close(plain["fused_add_rms_norm"][0].float(), want_out.float(), **tol)
    torch.testing.assert_close(plain["fused_add_rms_norm"][1], want_res, atol=0, rtol=0)
    torch.testing.assert_close(plain["silu_and_mul"].float(), silu_and_mul_ref(gate_up).float(),
                               **tol)


def test_spare_programs_change_nothing(device):
    check_unchanged(device, torch.float16, 4096, 3000)  # a byte count that is no line multiple


@pytest.mark.gpu
def test_gpu_prefetch_changes_nothing():
    # 96 MiB of weight, the first 24 MiB prefetched: real prefetch instructions, past the L2
    check_unchanged("cuda", torch.bfloat16, 48 << 20, 24 << 20)


def test_prefetch_only_for_small_batches():
    prefetch = L2Prefetch(torch.zeros(4), 16)
    assert prefetch.for_rows(1) is prefetch and prefetch.for_rows(MAX_ROWS) is prefetch
    assert prefetch.for_rows(MAX_ROWS + 1) is None
