"""AWQ W4A16: the reference against hand-computed tensors and an independent packer (round-to-
nearest quantization of float weights, packed as AutoAWQ's "gemm" checkpoints are), then
awq_gemv / awq_gemm / awq_linear against the reference.

The format, from AutoAWQ's WQLinear_GEMM.from_linear: qweight[:, j] |= q[:, 8j + order[i]] <<
4i with order = [0, 2, 4, 6, 1, 3, 5, 7], qzeros likewise; W = (q - z) * s per group of G rows.
"""

import pytest
import torch
import torch.nn.functional as F

from echo_kernels import awq_gemm, awq_gemv, awq_linear
from echo_kernels.awq import LINEAR_GEMM_ROWS, LINEAR_GEMV_ROWS, awq_dequantize
from echo_kernels.reference import awq_dequantize_ref, awq_linear_ref

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of int32 j holds column 8j + this[i]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, N] of 0..15 -> int32 [R, N // 8], AutoAWQ's packing (written from the format)."""
    rows, n = values.shape
    nibbles = values.long().reshape(rows, n // 8, 8)[:, :, list(AWQ_PACK_ORDER)]
    packed = (nibbles << (4 * torch.arange(8, device=values.device))).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def quantize_rtn(w: torch.Tensor, group_size: int, scale_dtype=torch.float16):
    """Asymmetric round-to-nearest of w [K, N] per group of G rows and column: (q [K, N],
    z [K/G, N], s [K/G, N] in scale_dtype) with w ~ (q - z) * s, q and z in 0..15."""
    k, n = w.shape
    groups = w.float().reshape(k // group_size, group_size, n)
    lo, hi = groups.amin(1), groups.amax(1)
    s = ((hi - lo).clamp_min(1e-5) / 15).to(scale_dtype)
    sf = s.float()
    z = torch.round(-lo / sf).clamp(0, 15)
    q = (torch.round(groups / sf[:, None]) + z[:, None]).clamp(0, 15)
    return q.reshape(k, n).long(), z.long(), s


def awq_tensors(k: int, n: int, group_size: int, device, seed: int = 0):
    """Random (qweight, qzeros, scales fp16) with every nibble value in play; W's entries are
    about 1 / sqrt(K), so x @ W is about 1 for x ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(0, 16, (k // group_size, n), generator=gen)
    s = (torch.rand(k // group_size, n, generator=gen) + 0.5) / (6 * k**0.5)
    return (pack_awq(q).to(device), pack_awq(z).to(device), s.to(torch.float16).to(device))


# ---------------------------------------------------------------------------------------------
# the packer and the reference, against hand-computed tensors

# K = 4, G = 2, N = 8: one int32 a row. Nibble i of each literal is written out below.
HAND_QWEIGHT = [0x76543210, 0xFEDCBA98 - 2**32, 0x77777777, 0x00000000]
HAND_QZEROS = [0x88888888 - 2**32, 0x01234567]  # zeros 8 everywhere; then 7 - i at nibble i
HAND_SCALES = [[0.5] * 8, [0.25 * (c + 1) for c in range(8)]]
# column c reads nibble (0, 4, 1, 5, 2, 6, 3, 7)[c]: 0x76543210 gives q = [0, 4, 1, 5, 2, 6, 3, 7]
HAND_Q = [[0, 4, 1, 5, 2, 6, 3, 7], [8, 12, 9, 13, 10, 14, 11, 15], [7] * 8, [0] * 8]
HAND_Z = [[8] * 8, [7, 3, 6, 2, 5, 1, 4, 0]]
HAND_W = [
    [-4.0, -2.0, -3.5, -1.5, -3.0, -1.0, -2.5, -0.5],  # (q - 8) / 2
    [0.0, 2.0, 0.5, 2.5, 1.0, 3.0, 1.5, 3.5],
    [0.0, 2.0, 0.75, 5.0, 2.5, 9.0, 5.25, 14.0],  # (7 - z) * s, s = 0.25 (c + 1)
    [-1.75, -1.5, -4.5, -2.0, -6.25, -1.5, -7.0, 0.0],  # -z * s
]


def hand_tensors(device):
    return (torch.tensor(HAND_QWEIGHT, dtype=torch.int32, device=device)[:, None],
            torch.tensor(HAND_QZEROS, dtype=torch.int32, device=device)[:, None],
            torch.tensor(HAND_SCALES, dtype=torch.float16, device=device))


def test_packer_matches_hand_literals():
    assert pack_awq(torch.tensor(HAND_Q))[:, 0].tolist() == HAND_QWEIGHT
    assert pack_awq(torch.tensor(HAND_Z))[:, 0].tolist() == HAND_QZEROS


def test_dequantize_ref_hand_made(device):
    qweight, qzeros, scales = hand_tensors(device)
    w = awq_dequantize_ref(qweight, qzeros, scales, 2)
    assert w.dtype == torch.float16 and w.shape == (4, 8)
    assert w.cpu().tolist() == HAND_W  # every value exact in fp16


def test_dequantize_hand_made(device):
    qweight, qzeros, scales = hand_tensors(device)
    w = awq_dequantize(qweight, qzeros, scales, 2, torch.float32)
    assert w.cpu().tolist() == HAND_W
    # past the GEMV's 16 rows a group under 16 (no tensor-core tile steps through it) takes the
    # dense weight: 20 rows of one-hot x pick W's rows
    x = torch.eye(4, device=device).repeat(5, 1)
    assert awq_linear(x, qweight, qzeros, scales, 2).cpu().tolist() == HAND_W * 5


def test_linear_ref_hand_made(device):
    qweight, qzeros, scales = hand_tensors(device)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.5, 0.5, 0.0, 0.0]],
                     device=device)
    y = awq_linear_ref(x, qweight, qzeros, scales, 2)
    want = [HAND_W[0], [a + b for a, b in zip(HAND_W[2], HAND_W[3])],
            [(a + b) / 2 for a, b in zip(HAND_W[0], HAND_W[1])]]
    assert y.dtype == torch.float32 and y.cpu().tolist() == want


@pytest.mark.parametrize("impl", ["gemv", "linear"])
def test_gemv_hand_made(device, impl):
    # the smallest tiles the format allows: block_k = G = 2, one int32 a row
    qweight, qzeros, scales = hand_tensors(device)
    x = torch.eye(4, device=device)
    if impl == "gemv":
        y = awq_gemv(x, qweight, qzeros, scales, 2, block_n=8, block_k=2, split_k=1)
    else:
        y = awq_linear(x, qweight, qzeros, scales, 2)
    assert y.cpu().tolist() == HAND_W


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group_size", [32, 128])
def test_rtn_round_trip(scale_dtype, group_size):
    # dequantize(pack(quantize(w))) is within half a step of w (plus the rounding of W to fp16)
    torch.manual_seed(0)
    w = torch.randn(256, 64) * torch.rand(1, 64) * 3
    q, z, s = quantize_rtn(w, group_size, scale_dtype)
    got = awq_dequantize_ref(pack_awq(q), pack_awq(z), s, group_size)
    assert got.dtype == scale_dtype
    step = s.float().repeat_interleave(group_size, 0)
    # an fp16 s may fall short of (hi - lo) / 15 by 2**-11 of it: the top value then clips, off
    # by up to 15 * 2**-11 of a step more
    slack = 1e-5 if scale_dtype == torch.float32 else 15 * 2.0**-11
    fp16_round = 0.0 if scale_dtype == torch.float32 else w.abs() * 2.0**-11
    assert ((got.float() - w).abs() <= step * (0.5 + slack) + fp16_round).all()
    # and the reference reads back the very nibbles that were packed
    assert torch.equal(torch.round(got.float() / step).long(),
                       q - z.repeat_interleave(group_size, 0))


# ---------------------------------------------------------------------------------------------
# kernels against the reference

TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}


def check(out, x, qweight, qzeros, scales, group_size):
    want = awq_linear_ref(x, qweight, qzeros, scales, group_size)
    assert out.shape == want.shape and out.dtype == x.dtype
    tol = TOL[x.dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,n,group_size", [(64, 32, 32), (256, 96, 64), (256, 32, 32),
                                            (64, 96, 64)])
@pytest.mark.parametrize("m", [1, 3, 16])
def test_gemv_matches_reference(device, m, k, n, group_size, dtype):
    # default tiles (64 columns: N = 96 has a masked block; the CPU stand-in SM count splits K)
    qweight, qzeros, scales = awq_tensors(k, n, group_size, device)
    x = torch.randn(m, k, device=device).to(dtype)
    check(awq_gemv(x, qweight, qzeros, scales, group_size), x, qweight, qzeros, scales,
          group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,n,group_size", [(64, 32, 32), (256, 96, 64), (256, 32, 32),
                                            (64, 96, 64)])
@pytest.mark.parametrize("m", [17, 40])
def test_gemm_matches_reference(device, m, k, n, group_size, dtype):
    qweight, qzeros, scales = awq_tensors(k, n, group_size, device)
    x = torch.randn(m, k, device=device).to(dtype)
    check(awq_gemm(x, qweight, qzeros, scales, group_size), x, qweight, qzeros, scales,
          group_size)


@pytest.mark.parametrize("options", [
    {"block_n": 32, "block_k": 16, "split_k": 1},  # one launch, no partial sums
    {"block_n": 8, "block_k": 32, "split_k": 3},  # 5 groups over 3 splits: 2, 2, 1
    {"block_n": 16, "block_k": 64, "split_k": 100},  # more splits asked than groups
    {"block_n": 64, "block_k": 8, "split_k": 2, "num_stages": 2},
    {"block_n": 32, "block_k": 32, "split_k": 1, "num_stages": 1, "num_warps": 2},
    {"block_n": 64, "block_k": 16, "split_k": 2, "pair_rows": False},  # a program a row
])
@pytest.mark.parametrize("m", [2, 5])
def test_gemv_knobs(device, m, options):
    qweight, qzeros, scales = awq_tensors(320, 96, 64, device, seed=1)
    x = torch.randn(m, 320, device=device).to(torch.float16)
    check(awq_gemv(x, qweight, qzeros, scales, 64, **options), x, qweight, qzeros, scales, 64)


@pytest.mark.parametrize("options", [
    {"block_m": 16, "block_n": 32, "block_k": 16, "split_k": 1, "group_m": 2},
    {"block_m": 32, "block_n": 16, "block_k": 32, "split_k": 3, "group_m": 1},
    {"block_m": 16, "block_n": 64, "block_k": 64, "split_k": 1, "num_warps": 2},
])
def test_gemm_knobs(device, options):
    # ragged M and N tiles, a run of row tiles cut short at the bottom (3 row tiles, GROUP_M 2)
    qweight, qzeros, scales = awq_tensors(128, 96, 64, device, seed=2)
    x = torch.randn(40, 128, device=device).to(torch.float16)
    check(awq_gemm(x, qweight, qzeros, scales, 64, **options), x, qweight, qzeros, scales, 64)


def test_bf16_gemv(device):
    # bf16 activations with the checkpoint's fp16 scales. (bf16 awq_gemm: the GPU test only;
    # the interpreter's tl.dot multiplies bf16 as the raw uint16 it stores them in)
    qweight, qzeros, scales = awq_tensors(128, 64, 32, device, seed=3)
    for m in (1, 2, 5):
        x = torch.randn(m, 128, device=device).to(torch.bfloat16)
        check(awq_gemv(x, qweight, qzeros, scales, 32), x, qweight, qzeros, scales, 32)


def test_gemm_few_rows(device):
    # awq_gemm takes any M: 3 rows in a 16-row tile
    qweight, qzeros, scales = awq_tensors(128, 64, 32, device, seed=3)
    x = torch.randn(3, 128, device=device).to(torch.float16)
    check(awq_gemm(x, qweight, qzeros, scales, 32, block_m=16), x, qweight, qzeros, scales, 32)


@pytest.mark.parametrize("k,n,group_size", [(256, 96, 64), (64, 2048, 32)])
def test_dequantize_rounds_the_reference_once(device, k, n, group_size):
    # (q - z) * s in float32, then one rounding to the target dtype: bit-equal to the reference
    # (N = 96 leaves most of a 1024-column block masked; N = 2048 fills two). bf16: the GPU test
    # below (the interpreter rounds float32 to bf16 toward zero)
    qweight, qzeros, scales = awq_tensors(k, n, group_size, device, seed=7)
    want = awq_dequantize_ref(qweight, qzeros, scales.float(), group_size)
    for dtype in (torch.float16, torch.float32):
        got = awq_dequantize(qweight, qzeros, scales, group_size, dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_split_k_deterministic(device):
    qweight, qzeros, scales = awq_tensors(256, 32, 32, device, seed=4)
    x = torch.randn(3, 256, device=device).to(torch.float16)
    first = awq_gemv(x, qweight, qzeros, scales, 32, split_k=4)
    assert torch.equal(first, awq_gemv(x, qweight, qzeros, scales, 32, split_k=4))


def swiglu_ref(x, qweight, qzeros, scales, group_size):
    """silu(gate) * up of the reference product's halves, gate and up rounded to x's dtype
    first (as two launches round them), silu's result too, the product in float32."""
    gate, up = awq_linear_ref(x, qweight, qzeros, scales, group_size).chunk(2, dim=-1)
    return (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_swiglu(device, m, split_k):
    # SwiGLU where the splits are added (split_k 3, and the default's splits), or after the one
    # launch (split_k 1); N = 96: gate and up of 48 outputs each, the 64-column blocks
    # straddling the halves
    qweight, qzeros, scales = awq_tensors(192, 96, 64, device, seed=8)
    x = torch.randn(m, 192, device=device).to(torch.float16)
    out = awq_gemv(x, qweight, qzeros, scales, 64, block_n=64, split_k=split_k, swiglu=True)
    want = swiglu_ref(x, qweight, qzeros, scales, 64)
    assert out.shape == (m, 48) and out.dtype == x.dtype
    # gate and up each carry fp16's rounding into the product: a few ulps
    torch.testing.assert_close(out.float(), want.float(), atol=5e-3, rtol=5e-3)
    for rows in (LINEAR_GEMV_ROWS + 1, LINEAR_GEMM_ROWS + 1):  # awq_gemm, the dense weight
        x = torch.randn(rows, 192, device=device).to(torch.float16)
        torch.testing.assert_close(
            awq_linear(x, qweight, qzeros, scales, 64, swiglu=True).float(),
            swiglu_ref(x, qweight, qzeros, scales, 64).float(), atol=5e-3, rtol=5e-3)


def test_linear_dispatch_and_edges(device):
    qweight, qzeros, scales = awq_tensors(64, 32, 32, device, seed=5)
    for m in (LINEAR_GEMV_ROWS, LINEAR_GEMV_ROWS + 1, 16, 17, LINEAR_GEMM_ROWS + 1):
        x = torch.randn(m, 64, device=device).to(torch.float16)
        check(awq_linear(x, qweight, qzeros, scales, 32), x, qweight, qzeros, scales, 32)
    assert awq_linear(torch.zeros(0, 64, device=device), qweight, qzeros, scales,
                      32).shape == (0, 32)
    with pytest.raises(ValueError, match="1..16 rows"):
        awq_gemv(torch.zeros(17, 64, device=device), qweight, qzeros, scales, 32)
    with pytest.raises(AssertionError, match="block_k"):
        awq_gemv(torch.zeros(1, 64, device=device), qweight, qzeros, scales, 32, block_k=64)
    with pytest.raises(AssertionError, match="not a multiple"):
        awq_gemv(torch.zeros(1, 64, device=device), qweight, qzeros, scales, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4096, 12288])
@pytest.mark.parametrize("m", [1, 4, 16, 256, 4096])
def test_gpu_real_shapes(m, n, dtype):
    k, group_size = 4096, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    out = awq_linear(x, qweight, qzeros, scales, group_size)
    want = awq_linear_ref(x, qweight, qzeros, scales, group_size)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_dequantize_bf16():
    qweight, qzeros, scales = awq_tensors(4096, 12288, 128, "cuda", seed=7)
    want = awq_dequantize_ref(qweight, qzeros, scales.float(), 128).to(torch.bfloat16)
    assert torch.equal(awq_dequantize(qweight, qzeros, scales, 128, torch.bfloat16), want)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_kernel_knobs(m):
    # the paths awq_linear does not take by default: one launch, two stages, a program a row,
    # a 16-row GEMM
    k, n, group_size = 4096, 4096, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=1)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = awq_linear_ref(x, qweight, qzeros, scales, group_size).float()
    for out in (awq_gemv(x, qweight, qzeros, scales, group_size, split_k=1),
                awq_gemv(x, qweight, qzeros, scales, group_size, num_stages=2),
                awq_gemv(x, qweight, qzeros, scales, group_size, pair_rows=False),
                awq_gemm(x, qweight, qzeros, scales, group_size, block_m=16)):
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemm_prefill_rows(dtype):
    # awq_gemm's large tiles (awq_linear hands these rows to the dense weight and cuBLAS)
    k, n, group_size = 4096, 4096, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=2)
    x = torch.randn(4096, k, device="cuda", dtype=dtype)
    out = awq_gemm(x, qweight, qzeros, scales, group_size)
    want = awq_linear_ref(x, qweight, qzeros, scales, group_size)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2])
def test_gpu_gemv_swiglu(m):
    # Llama-3.1-8B's gate_up (2 x 14336 outputs) in bf16: SwiGLU in the split sum
    k, n, group_size = 4096, 28672, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=9)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = swiglu_ref(x, qweight, qzeros, scales, group_size).float()
    out = awq_linear(x, qweight, qzeros, scales, group_size, swiglu=True)
    assert out.shape == (m, n // 2)
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)
