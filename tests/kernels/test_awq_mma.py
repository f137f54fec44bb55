"""AWQ on the tensor cores (echo_kernels/awq_mma.py): the repacked layout against its written
definition, the dequantization from it against the reference (CPU: the interpreter), and the
Gluon GEMV against the reference (GPU only: Gluon has no interpreter)."""

import functools

import pytest
import torch
import torch.nn.functional as F
from test_awq import awq_tensors

from echo.layers.linear import GateUpParallelLinear
from echo.layers.quantization import AwqConfig
from echo.worker.linear_tuning import AWQ_MMA_CANDIDATES
from echo_kernels import awq_mma
from echo_kernels.awq_mma import (
    GEMM_MAX_ROWS,
    MMA_MAX_ROWS,
    arrival_counts,
    awq_dequantize_repacked,
    awq_gemm_repacked,
    awq_mma_gemv,
    awq_mma_linear,
    repack_awq,
)
from echo_kernels.reference import awq_linear_ref, awq_unpack_ref

# the one-row settings the start-up tuning times: the kernel's own and its candidates
ONE_ROW_SETTINGS = [awq_mma._ONE_ROW, *AWQ_MMA_CANDIDATES]


def read_repacked(words: torch.Tensor, group_size: int) -> torch.Tensor:
    """q [K, N] from the repacked words, element by element as the layout is defined: word [nt,
    kc, lane, j] holds column 16 nt + 8 n3 + lane // 4 at k = G g + (G / 4)(lane % 4) + 4 s + 2 h
    + k0 (g, s: the group and step of chunk kc and j) in nibble n3 + 2 h + 4 k0."""
    nt_count, kc_count = words.shape[:2]
    q = torch.full((kc_count * 64, nt_count * 16), -1, dtype=torch.long)
    per_group = group_size // 64
    for nt in range(nt_count):
        for kc in range(kc_count):
            g, s_base = divmod(kc, per_group)
            for lane in range(32):
                for j in range(4):
                    word = int(words[nt, kc, lane, j]) & 0xFFFFFFFF
                    for n3 in range(2):
                        for h in range(2):
                            for k0 in range(2):
                                k = (g * group_size + group_size // 4 * (lane % 4)
                                     + 4 * (4 * s_base + j) + 2 * h + k0)
                                n = 16 * nt + 8 * n3 + lane // 4
                                q[k, n] = (word >> 4 * (n3 + 2 * h + 4 * k0)) & 15
    return q


@pytest.mark.parametrize("group_size", [64, 128])
def test_repack_follows_the_layout(group_size):
    qweight, _, _ = awq_tensors(group_size * 2, 32, group_size, "cpu")
    words = repack_awq(qweight, group_size)
    assert words.shape == (2, group_size * 2 // 64, 32, 4) and words.dtype == torch.int32
    assert torch.equal(read_repacked(words, group_size), awq_unpack_ref(qweight))


def test_repack_refuses_small_groups():
    qweight, _, _ = awq_tensors(64, 32, 32, "cpu")
    with pytest.raises(ValueError, match="group size divisible by 64"):
        repack_awq(qweight, 32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("k,n,group_size", [(128, 32, 64), (256, 48, 128)])
def test_dequantize_repacked_matches_reference(device, k, n, group_size, dtype):
    qweight, qzeros, scales = awq_tensors(k, n, group_size, device)
    dense = awq_dequantize_repacked(repack_awq(qweight, group_size), qzeros, scales, group_size,
                                    dtype)
    # (q - z) * s in float32, rounded once to dtype
    q, z = awq_unpack_ref(qweight), awq_unpack_ref(qzeros).repeat_interleave(group_size, 0)
    ref = ((q - z).float() * scales.float().repeat_interleave(group_size, 0)).to(dtype)
    assert dense.shape == (n, k)
    torch.testing.assert_close(dense, ref.t(), rtol=0, atol=0)


@pytest.mark.parametrize("options", [dict(block_m=16, tiles=2, split_k=1),
                                     dict(block_m=16, tiles=1, split_k=2, swiglu=True),
                                     dict(swiglu=True)])
def test_gemm_repacked_matches_reference(device, options):
    """awq_gemm_repacked against the float32 reference: its tiles and K splits, SwiGLU, and
    the default tile (128 rows x 256 columns) over rows that do not fill it."""
    k, n, group_size, m = 256, 256, 128, 19
    qweight, qzeros, scales = awq_tensors(k, n, group_size, device, seed=m)
    x = torch.randn(m, k, device=device, dtype=torch.float16)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    out = awq_gemm_repacked(x, repack_awq(qweight, group_size), qzeros, scales, group_size,
                            **options)
    if options.get("swiglu"):
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    assert out.dtype == torch.float16 and out.shape == ref.shape
    # fp16 x times weights exact in fp16 (q - z up to 15, times a fp16 scale), float32 sums:
    # the output's rounding and the summation order differ
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 13, 40, MMA_MAX_ROWS + 3, GEMM_MAX_ROWS + 3])
@pytest.mark.parametrize("k,n,group_size", [(512, 256, 128), (1024, 384, 64)])
def test_mma_linear_matches_reference(m, k, n, group_size, dtype):
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    rq = repack_awq(qweight, group_size)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    out = awq_mma_linear(x, rq, qzeros, scales, group_size)
    assert out.dtype == dtype and out.shape == (m, n)
    # the products are exact (bf16/fp16 x times 1 + q u); what differs is float32 summation
    # order and the output's rounding
    tol = 8e-3 if dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(split_k=1), dict(split_k=3), dict(warps=4, tiles=2),
                                     dict(rows=16), dict(rows=32), dict(split_k=4),
                                     dict(warps=4, tiles=2, rows=16), dict(ahead=2),
                                     dict(ahead=2, split_k=1), dict(ahead=2, split_k=3),
                                     dict(ahead=2, warps=4, tiles=2, rows=32)])
def test_mma_gemv_knobs_and_swiglu(options):
    """Settings against the reference, also splits of one group (split_k=4), and two groups
    ahead over splits of four groups, two, and (the default split here) one."""
    k, n, group_size = 512, 256, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda")
    x = torch.randn(5, k, device="cuda", dtype=torch.bfloat16)
    rq = repack_awq(qweight, group_size)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    out = awq_mma_gemv(x, rq, qzeros, scales, group_size, **options)
    torch.testing.assert_close(out.float(), ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())
    glu = awq_mma_gemv(x, rq, qzeros, scales, group_size, swiglu=True, **options)
    gate, up = ref.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(glu.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def count_split_sum_launches(monkeypatch) -> list:
    """One entry a call of awq.py's split-sum launcher from awq_mma_gemv."""
    calls = []
    launch_split = awq_mma._launch_split

    def counted(*args, **kwargs):
        calls.append(args[1])  # the split count
        return launch_split(*args, **kwargs)

    monkeypatch.setattr(awq_mma, "_launch_split", counted)
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("m,options", [(1, dict(split_k=3)), (5, dict(split_k=4, tiles=2, ahead=2)),
                                       (13, dict(split_k=2, rows=16)),
                                       (40, dict(split_k=4, rows=32))])
def test_mma_gemv_sums_its_splits_inside(m, options, swiglu, monkeypatch):
    """With arrival counts the last split of a column block adds the partial sums (SwiGLU
    too), no split-sum launch: the reference's values, the split-sum launch's up to rounding,
    the same again on a second call (the counts are left zero, and the sum's order is fixed)."""
    k, n, group_size = 512, 512, 64
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    rq = repack_awq(qweight, group_size)
    arrivals = arrival_counts(n, x.device)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    if swiglu:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    run = functools.partial(awq_mma_gemv, x, rq, qzeros, scales, group_size, swiglu=swiglu,
                            **options)
    launches = count_split_sum_launches(monkeypatch)
    fused = run(arrivals=arrivals)
    assert launches == []
    tol = 2e-2 if swiglu else 8e-3
    torch.testing.assert_close(fused.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    assert not arrivals.any()
    assert torch.equal(run(arrivals=arrivals), fused)
    # the launch adds in another order: a gate a rounding step apart moves silu's output by
    # more than bf16's default tolerance where the gate is large and negative
    torch.testing.assert_close(fused.float(), run().float(), rtol=tol,
                               atol=tol * ref.abs().max().item())
    assert launches == [options["split_k"]]


@pytest.mark.gpu
@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("split_k", [1, 3, 5, 12, None])
@pytest.mark.parametrize("group_size", [64, 128])
def test_one_row_with_x_in_shared_memory(group_size, split_k, ahead):
    """One row, x put in shared memory a split at a time (the 10 or 5 groups whole, in splits
    of 4, 4, 2 or 2, 2, 1, of 2 or 1, of 1, and the default's), its splits summed inside and by
    the launch: the reference's values, and x in registers' up to the summation order."""
    k, n = 640, 256
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=split_k or 0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rq = repack_awq(qweight, group_size)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    tol = dict(rtol=8e-3, atol=8e-3 * ref.abs().max().item())
    for arrivals in (arrival_counts(n, x.device), None):
        shared, registers = (awq_mma_gemv(x, rq, qzeros, scales, group_size, arrivals,
                                          split_k=split_k, ahead=ahead, x_shared=flag)
                             for flag in (True, False))
        torch.testing.assert_close(shared.float(), ref, **tol)
        torch.testing.assert_close(shared.float(), registers.float(), **tol)
    glu = awq_mma_gemv(x, rq, qzeros, scales, group_size, arrival_counts(n, x.device),
                       split_k=split_k, ahead=ahead, x_shared=True, swiglu=True)
    gate, up = ref.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(glu.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("setting", ONE_ROW_SETTINGS, ids=str)
def test_every_one_row_setting_the_tuning_offers(setting):
    """One row through awq_mma_gemv's own default and each setting of the start-up tuning's
    AWQ_MMA_CANDIDATES (x in shared memory, as at one row by default; two 16-column tiles a
    warp and 8 warps among them, which no other one-row test takes), its splits summed inside
    and by the launch, with SwiGLU too, at a Llama-3.1-8B qkv's width and groups (6144 x 4096,
    group 128): the reference's values."""
    warps, tiles, per_sm, ahead = setting
    k, n, group_size = 4096, 6144, 128
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda", seed=sum(setting))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    rq = repack_awq(qweight, group_size)
    ref = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size)
    run = functools.partial(awq_mma_gemv, x, rq, qzeros, scales, group_size, warps=warps,
                            tiles=tiles, per_sm=per_sm, ahead=ahead)
    for arrivals in (arrival_counts(n, x.device), None):
        torch.testing.assert_close(run(arrivals).float(), ref, rtol=8e-3,
                                   atol=8e-3 * ref.abs().max().item())
    gate, up = ref.chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(run(arrival_counts(n, x.device), swiglu=True).float(), want,
                               rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
def test_swiglu_blocks_that_do_not_pair_take_the_split_sum_launch(monkeypatch):
    """N / 2 = 192 is not a whole number of 128-column blocks: gate and up blocks cannot share
    a count, so the split sum is launched as without arrival counts, and right."""
    k, n, group_size = 256, 384, 64
    qweight, qzeros, scales = awq_tensors(k, n, group_size, "cuda")
    x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
    arrivals = arrival_counts(n, x.device)
    launches = count_split_sum_launches(monkeypatch)
    glu = awq_mma_gemv(x, repack_awq(qweight, group_size), qzeros, scales, group_size, arrivals,
                       tiles=2, split_k=2, swiglu=True)
    assert launches == [2] and not arrivals.any()
    gate, up = awq_linear_ref(x.float(), qweight, qzeros, scales, group_size).chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(glu.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("sum_inside", [False, True])
def test_a_gate_up_layer_repacked_at_load_keeps_its_outputs(sum_inside):
    """LinearBase.use_awq_tensor_cores: the same layer's product and SwiGLU, AutoAWQ's layout
    against the repacked one (its GEMV's splits summed by a launch, or inside with the layer's
    arrival counts), at one row, a few, past MMA_MAX_ROWS (awq_gemm_repacked) and past
    GEMM_MAX_ROWS (the dense weight)."""
    k, intermediate, group_size = 256, 128, 64
    qweight, qzeros, scales = awq_tensors(k, 2 * intermediate, group_size, "cuda")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            layer = GateUpParallelLinear(k, intermediate, quant=AwqConfig(group_size=group_size))
    finally:
        torch.set_default_dtype(previous)
    for param, value in ((layer.qweight, qweight), (layer.qzeros, qzeros),
                         (layer.scales, scales.to(torch.bfloat16))):
        param.data.copy_(value)
    rows = (1, 6, MMA_MAX_ROWS + 16, GEMM_MAX_ROWS + 5)
    xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows]
    before = [(layer.matmul(x).float(), layer.swiglu(x).float()) for x in xs]
    assert layer.use_awq_tensor_cores(sum_inside)
    assert layer.qweight.shape == (2 * intermediate // 16, k // 64, 32, 4)
    assert (layer.awq_arrivals is not None) == sum_inside
    for x, (product, glu) in zip(xs, before):
        for got, want in ((layer.matmul(x).float(), product), (layer.swiglu(x).float(), glu)):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
