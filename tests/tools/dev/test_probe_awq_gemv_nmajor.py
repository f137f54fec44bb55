"""probe_awq_gemv_nmajor's N-major repacking and GEMV, under Triton's interpreter: the repacked
weight unpacks to AutoAWQ's values, and the kernel matches the dequantized reference (float32
and float16 x, ragged columns, several groups)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "dev"))

from probe_awq_gemv_nmajor import _POSITION_SHIFTS, n_major_gemv, repack_n_major  # noqa: E402

from echo_kernels.reference import awq_linear_ref, awq_unpack_ref  # noqa: E402
from tests.kernels.test_awq import awq_tensors  # noqa: E402


def test_repacked_words_hold_eight_consecutive_k_of_a_column():
    qweight, qzeros, scales = awq_tensors(64, 16, 32, "cpu", seed=3)
    packed, zeros, scales_n = repack_n_major(qweight, qzeros, scales)
    q = awq_unpack_ref(qweight)  # [K, N]
    assert packed.shape == (16, 8) and packed.dtype == torch.int32
    for n in (0, 5, 15):
        for j in (0, 7):
            word = int(packed[n, j]) & 0xFFFFFFFF
            assert [(word >> shift) & 15 for shift in _POSITION_SHIFTS] == \
                q[8 * j:8 * j + 8, n].tolist()
    assert torch.equal(zeros.long(), awq_unpack_ref(qzeros).t())
    assert torch.equal(scales_n, scales.t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group,block_n", [
    (40, 256, 64, 16),  # ragged columns (40 = 2.5 blocks), four groups
    (16, 128, 32, 8),
])
def test_matches_the_dequantized_reference(dtype, n, k, group, block_n):
    qweight, qzeros, scales = awq_tensors(k, n, group, "cpu", seed=1)
    x = torch.randn(1, k).to(dtype)
    out = n_major_gemv(x, *repack_n_major(qweight, qzeros, scales), group, block_n)
    expected = awq_linear_ref(x.float(), qweight, qzeros, scales, group)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
