"""tune_one_row_linears: per shape, the GEMV replaces cuBLAS (and an AWQ GEMV tile awq_gemv's
default) only where it is timed faster by the margin, and a tuned layer then uses it for one-row
inputs only."""

import functools

import pytest
import torch
import torch.nn.functional as F

from echo.distributed.parallel_state import SINGLE
from echo.layers.activation import silu_and_mul
from echo.layers.linear import (
    ColumnParallelLinear,
    GateUpParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from echo.layers.quantization import AwqConfig
from echo.worker.linear_tuning import MIN_GAIN, tune_one_row_linears
from echo_kernels.reference import awq_linear_ref
from tests.kernels.test_awq import awq_tensors


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a1 = ColumnParallelLinear(8, 16)  # shape (16, 8), twice: one choice for both
        self.a2 = ColumnParallelLinear(8, 16)
        self.b = RowParallelLinear(16, 8)  # shape (8, 16)
        self.c = ReplicatedLinear(8, 4, True, SINGLE)  # a bias: never tuned
        for p in self.parameters():
            p.data.normal_()


def kernel_for(*tile, swiglu=False):
    def kernel(x, w):  # a stand-in GEMV: recognizable output, same shape
        if swiglu:  # silu(gate) * up, plus the mark
            return silu_and_mul(F.linear(x, w)) + 2000.0
        return F.linear(x, w) + 1000.0

    kernel.tile = (*tile, "swiglu") if swiglu else tile
    return kernel


def fake_timer(times):
    """Times by (shape, tile or 'cublas', with "then swiglu" for a matmul timed with SwiGLU's
    launch after it); records which weights each call streamed."""
    seen = []

    def timer(fn, x, operands):
        weight = operands[0][0]  # the weight [N, K], or AWQ's qweight [K, N / 8]
        seen.append((tuple(weight.shape), len(operands)))
        assert x.shape == (1, weight.shape[1] if len(operands[0]) == 1 else weight.shape[0])
        then_swiglu = isinstance(fn, functools.partial)  # _then_swiglu(matmul)
        matmul = fn.args[0] if then_swiglu else fn
        key = getattr(matmul, "tile", "cublas")
        return times[(tuple(weight.shape), (key, "then swiglu") if then_swiglu else key)]

    return timer, seen


def test_faster_tiles_replace_cublas_only_beyond_the_margin():
    net = Net()
    tiles = [(8, 512, False, 4), (4, 1024, True, 2)]
    times = {((16, 8), "cublas"): 10.0, ((16, 8), tiles[0]): 9.0, ((16, 8), tiles[1]): 8.0,
             # 2% faster: inside the margin, cuBLAS stays
             ((8, 16), "cublas"): 10.0, ((8, 16), tiles[0]): 10.0 / 1.02,
             ((8, 16), tiles[1]): 11.0}
    timer, seen = fake_timer(times)
    choices = {c.shape: c for c in tune_one_row_linears(net, timer, lambda k: tiles,
                                                            kernel_for)}
    assert MIN_GAIN > 1.02
    assert set(choices) == {(16, 8), (8, 16)}  # the biased layer was not timed
    assert choices[(16, 8)].tile == tiles[1] and choices[(16, 8)].best_us == 8.0
    assert choices[(16, 8)].baseline_us == 10.0
    assert choices[(16, 8)].num_layers == 2 and ((16, 8), 2) in seen  # both weights streamed
    assert choices[(8, 16)].tile is None and choices[(8, 16)].best_us == 10.0
    assert "cuBLAS 10.0 us -> small_m_linear 4x1024 prefetch 2 warps 8.0 us" in \
        choices[(16, 8)].describe()

    one, two = torch.randn(1, 8), torch.randn(2, 8)
    for layer in (net.a1, net.a2):
        assert torch.allclose(layer(one), F.linear(one, layer.weight) + 1000.0)
        assert torch.allclose(layer(two), F.linear(two, layer.weight))  # two rows: cuBLAS
    x = torch.randn(1, 16)
    assert torch.allclose(net.b(x), F.linear(x, net.b.weight))
    assert net.c.small_m_kernels == {}


class GatedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.g1 = GateUpParallelLinear(8, 6)  # [gate; up] of shape (12, 8), twice
        self.g2 = GateUpParallelLinear(8, 6)
        self.plain = ColumnParallelLinear(8, 12)  # the same shape, no SwiGLU after it
        for p in self.parameters():
            p.data.normal_()


@pytest.mark.parametrize("fused_wins", [True, False])
def test_gate_up_layers_weigh_swiglu_inside_the_gemv(fused_wins):
    net = GatedNet()
    tile = (8, 512, True, 4)
    shape = (12, 8)
    times = {(shape, "cublas"): 10.0, (shape, tile): 8.0,  # the plain layer's
             (shape, ("cublas", "then swiglu")): 12.0, (shape, (tile, "then swiglu")): 9.0,
             (shape, (*tile, "swiglu")): 7.0 if fused_wins else 9.5}
    timer, _ = fake_timer(times)
    choices = tune_one_row_linears(net, timer, lambda k: [tile], kernel_for)
    gated = next(c for c in choices if c.gated)
    plain = next(c for c in choices if not c.gated)
    assert plain.tile == tile and plain.best_us == 8.0 and gated.baseline_us == 12.0
    assert gated.tile == tile and gated.swiglu == fused_wins
    assert gated.best_us == (7.0 if fused_wins else 9.0)
    assert ("SwiGLU inside 7.0 us" in gated.describe()) == fused_wins
    one, two = torch.randn(1, 8), torch.randn(2, 8)
    for layer in (net.g1, net.g2):
        plain_swiglu = silu_and_mul(F.linear(one, layer.weight))
        if fused_wins:  # one row through the SwiGLU kernel, the matmul itself left alone
            assert torch.allclose(layer.swiglu(one), plain_swiglu + 2000.0)
            assert layer.small_m_kernels == {}
        else:  # the tile for the matmul, SwiGLU's own launch after it
            assert torch.allclose(layer.swiglu(one), silu_and_mul(F.linear(one, layer.weight)
                                                                  + 1000.0))
            assert layer.swiglu_kernels == {}
        two_expected = silu_and_mul(F.linear(two, layer.weight))
        assert torch.allclose(layer.swiglu(two), two_expected)  # two rows: untouched


class AwqNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        group = AwqConfig(group_size=16)
        self.a1 = ColumnParallelLinear(32, 16, quant=group)  # N = 16, K = 32, twice
        self.a2 = ColumnParallelLinear(32, 16, quant=group)
        self.b = RowParallelLinear(32, 8, quant=group)  # N = 8, K = 32
        self.dense = ColumnParallelLinear(8, 16)  # a dense layer beside them, timed on its own
        for seed, layer in enumerate((self.a1, self.a2, self.b)):
            qweight, qzeros, scales = awq_tensors(32, layer.scales.shape[1], 16, "cpu", seed)
            layer.qweight.data, layer.qzeros.data = qweight, qzeros
            layer.scales.data = scales.float()
        self.dense.weight.data.normal_()


def awq_kernel_for(*tile):
    def kernel(x, qweight, qzeros, scales, group_size):
        return awq_linear_ref(x, qweight, qzeros, scales, group_size) + 1000.0

    kernel.tile = tile
    return kernel


def test_awq_layers_take_a_faster_gemv_tile_by_shape():
    net = AwqNet()
    tiles = [(1024, 8, 8, 3), (512, 16, 16, 3)]
    # keyed by qweight's shape [K, N / 8]: (32, 2) for N = 16, (32, 1) for N = 8
    times = {((32, 2), "cublas"): 10.0, ((32, 2), tiles[0]): 9.0, ((32, 2), tiles[1]): 9.5,
             ((32, 1), "cublas"): 10.0, ((32, 1), tiles[0]): 10.0 / 1.02,
             ((32, 1), tiles[1]): 12.0, ((16, 8), "cublas"): 10.0}
    timer, seen = fake_timer(times)
    # a tile whose 32 rows a step do not divide the group of 16 is never timed (KeyError)
    choices = tune_one_row_linears(net, timer, lambda k: (), kernel_for, [*tiles, (512, 32, 8, 3)],
                                   awq_kernel_for)
    by_shape = {(c.shape, c.awq_group): c for c in choices}
    assert set(by_shape) == {((16, 32), 16), ((8, 32), 16), ((16, 8), None)}
    assert ((32, 2), 2) in seen  # both layers of that shape streamed
    won = by_shape[((16, 32), 16)]
    assert won.tile == tiles[0] and won.baseline_us == 10.0 and won.best_us == 9.0
    assert "AWQ 16x32 group 16 (2 layers): awq_gemv 10.0 us -> awq_gemv 8x1024 8 programs " \
        "an SM 3 stages 9.0 us" in won.describe()
    assert by_shape[((8, 32), 16)].tile is None  # 2% faster: the default stays

    one, two = torch.randn(1, 32), torch.randn(2, 32)
    for layer in (net.a1, net.a2):
        args = (layer.qweight, layer.qzeros, layer.scales, 16)
        assert torch.allclose(layer(one), awq_linear_ref(one, *args) + 1000.0)
        assert torch.allclose(layer(two), awq_linear_ref(two, *args))  # two rows: the default
    args = (net.b.qweight, net.b.qzeros, net.b.scales, 16)
    assert torch.allclose(net.b(one), awq_linear_ref(one, *args))
    assert net.b.small_m_kernels == {} and net.dense.small_m_kernels == {}


@pytest.mark.gpu
def test_gpu_tuning_with_real_timings_keeps_outputs(monkeypatch, tiny_llama):
    from echo import LLM, SamplingParams
    from echo.worker.linear_tuning import cuda_graph_timer
    from tests.entrypoints.test_llm import PROMPTS
    from tests.worker.test_gpu_runner import gpu_llm

    net = Net().cuda().to(torch.bfloat16)
    choices = tune_one_row_linears(net, cuda_graph_timer)
    assert all(c.baseline_us > 0 and c.best_us <= c.baseline_us for c in choices)
    x = torch.randn(1, 8, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(net.a1(x).float(), F.linear(x.float(), net.a1.weight.float()),
                               atol=2e-2, rtol=2e-2)

    # the engine with tuning on (whatever it picks on this card) decodes the same tokens
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def greedy(llm: LLM):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    monkeypatch.setenv("ECHO_TUNE_SMALL_M", "0")
    expected = greedy(gpu_llm(tiny_llama))
    monkeypatch.setenv("ECHO_TUNE_SMALL_M", "1")
    assert greedy(gpu_llm(tiny_llama)) == expected
