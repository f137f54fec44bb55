"""tune_one_row_linears: per shape, the GEMV replaces cuBLAS (and an AWQ GEMV tile awq_gemv's
default) only where it is timed faster by the margin, and a tuned layer then uses it for one-row
inputs only."""

import functools

import pytest
import torch
import torch.nn.functional as F

from echo.distributed.parallel_state import SINGLE
from echo.layers.activation import silu_and_mul
from echo.layers.layernorm import RMSNorm
from echo.layers.linear import (
    ColumnParallelLinear,
    GateUpParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from echo.layers.quantization import AwqConfig
from echo.worker.linear_tuning import MIN_GAIN, tune_one_row_linears
from echo_kernels.reference import awq_linear_ref, rms_norm_ref
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


# what the tuning wraps around a kernel it times (linear_tuning's partials)
AFTER_NORM, THEN_SWIGLU, NORM_INSIDE = "_norm_then_matmul", "_matmul_then_swiglu", "_normed_call"


def fake_timer(times):
    """Times by (shape, tile or 'cublas') or, for a kernel timed with launches around it or
    the norm inside, (shape, (tile or 'cublas', the wrappers' names outermost first));
    records which weights each call streamed."""
    seen = []

    def timer(fn, x, operands, lead="norm"):
        # the weight [N, K], AWQ's qweight [K, N / 8] or the tensor cores' [N/16, K/64, 32, 4]
        weight = operands[0][0]
        seen.append((tuple(weight.shape), len(operands)))
        k = (weight.shape[1] if len(operands[0]) == 1 else
             weight.shape[1] * 64 if weight.dim() == 4 else weight.shape[0])
        assert x.shape == (1, k)
        around = []
        while isinstance(fn, functools.partial):
            around.append(fn.func.__name__)
            fn = fn.args[-1]  # the wrapped kernel is each partial's last argument
        key = getattr(fn, "tile", "cublas")
        # behind a GEMV exactly where the layer is timed with the norm before it
        assert (lead == "gemv") == (AFTER_NORM in around or NORM_INSIDE in around)
        return times[(tuple(weight.shape), (key, tuple(around)) if around else key)]

    return timer, seen


def normed_kernel_for(*tile, swiglu=False):
    def kernel(x, residual, norm_weight, eps, w):  # norm(x + residual), then the layer
        total = x if residual is None else x + residual
        y = F.linear(rms_norm_ref(total, norm_weight, eps), w)
        return (silu_and_mul(y) if swiglu else y) + 3000.0, total

    kernel.tile = tile
    return kernel


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
        self.qkv = QKVParallelLinear(8, 4, 2, 1)  # (16, 8): after a norm, no SwiGLU
        self.plain = ColumnParallelLinear(8, 12)  # gate/up's shape, neither
        for p in self.parameters():
            p.data.normal_()


@pytest.mark.parametrize("winner", ["swiglu inside", "then swiglu", "norm inside"])
def test_gate_up_and_qkv_weigh_the_norm_and_swiglu_inside_the_gemv(winner):
    net = GatedNet()
    tile, preload = (8, 4, True, 4), (2, 8, True, 4)  # preload: a tile over all of K (8)
    gated, qkv = (12, 8), (16, 8)
    fast = {"swiglu inside": 7.0, "then swiglu": 7.5, "norm inside": 6.0}
    slow = 9.5
    times = {(gated, "cublas"): 10.0, (gated, tile): 8.0, (gated, preload): 9.0,  # plain
             (qkv, ("cublas", (AFTER_NORM,))): 11.0, (qkv, (tile, (AFTER_NORM,))): 10.5,
             (qkv, (preload, (AFTER_NORM,))): 10.5, (qkv, (preload, (NORM_INSIDE,))): 5.0}
    for t in (tile, preload):
        times[(gated, (t, (AFTER_NORM, THEN_SWIGLU)))] = slow
        times[(gated, ((*t, "swiglu"), (AFTER_NORM,)))] = slow
    times[(gated, ("cublas", (AFTER_NORM, THEN_SWIGLU)))] = 12.0
    times[(gated, (tile, (AFTER_NORM, THEN_SWIGLU)))] = fast["then swiglu"]
    times[(gated, ((*tile, "swiglu"), (AFTER_NORM,)))] = fast["swiglu inside"]
    times[(gated, (preload, (NORM_INSIDE,)))] = fast["norm inside"] if winner == "norm inside" \
        else slow
    if winner == "then swiglu":
        times[(gated, ((*tile, "swiglu"), (AFTER_NORM,)))] = slow
    timer, _ = fake_timer(times)
    choices = tune_one_row_linears(net, timer, lambda k: [tile, preload], kernel_for,
                                   make_normed_kernel=normed_kernel_for)
    by_shape = {(c.shape, c.gated, c.normed): c for c in choices}
    plain, gate_up = by_shape[(gated, False, False)], by_shape[(gated, True, True)]
    assert plain.tile == tile and plain.best_us == 8.0
    assert gate_up.baseline_us == 12.0 and gate_up.best_us == fast[winner]
    assert gate_up.tile == (preload if winner == "norm inside" else tile)
    assert (gate_up.swiglu, gate_up.norm_inside) == {
        "swiglu inside": (True, False), "then swiglu": (False, False),
        "norm inside": (True, True)}[winner]  # gate/up normed: SwiGLU inside too
    assert by_shape[(qkv, False, True)].norm_inside  # qkv: the norm inside wins at 5.0
    assert "norm inside" in by_shape[(qkv, False, True)].describe()

    norm = RMSNorm(8)
    norm.weight.data.normal_()
    one, two, residual = torch.randn(1, 8), torch.randn(2, 8), torch.randn(1, 8)
    for layer in (net.g1, net.g2):
        unfused = silu_and_mul(F.linear(rms_norm_ref(one + residual, norm.weight, 1e-6),
                                        layer.weight))
        act, total = layer.normed_swiglu(norm, one, residual)
        torch.testing.assert_close(total, one + residual)
        mark = {"swiglu inside": 2000.0, "norm inside": 3000.0}.get(winner)
        if winner == "then swiglu":  # the tile for the matmul, SwiGLU's own launch after it
            plain_in = rms_norm_ref(one + residual, norm.weight, 1e-6)
            unfused = silu_and_mul(F.linear(plain_in, layer.weight) + 1000.0)
            mark = 0.0
        torch.testing.assert_close(act, unfused + mark)
        assert layer.swiglu(two).shape == (2, 6)  # two rows: untouched
        torch.testing.assert_close(layer.swiglu(two), silu_and_mul(F.linear(two, layer.weight)))
    # the first layer's norm has no residual: the sum is x itself
    out, total = net.qkv.normed(norm, one, None)
    assert total is one
    torch.testing.assert_close(out, F.linear(rms_norm_ref(one, norm.weight, 1e-6),
                                             net.qkv.weight) + 3000.0)


def test_runs_of_blocks_are_timed_as_fifth_tile_fields():
    # with gemv_runs, each tile over the whole of K is timed again with its programs taking
    # runs of blocks for each count of programs an SM, with the norm inside and without; the
    # winner's count reaches the kernel
    net = GatedNet()
    tile, preload = (8, 4, True, 4), (2, 8, True, 4)
    runs2, runs4 = (*preload, 2), (*preload, 4)
    qkv, plain = (16, 8), (12, 8)
    times = {(qkv, ("cublas", (AFTER_NORM,))): 11.0, (qkv, (tile, (AFTER_NORM,))): 10.5,
             (qkv, (preload, (AFTER_NORM,))): 10.5, (qkv, (runs2, (AFTER_NORM,))): 10.0,
             (qkv, (runs4, (AFTER_NORM,))): 10.0, (qkv, (preload, (NORM_INSIDE,))): 6.0,
             (qkv, (runs2, (NORM_INSIDE,))): 5.0, (qkv, (runs4, (NORM_INSIDE,))): 5.5,
             (plain, "cublas"): 10.0, (plain, tile): 8.0, (plain, preload): 9.0,
             (plain, runs2): 9.0, (plain, runs4): 7.0}
    timer, _ = fake_timer(times)

    def timer_for(fn, x, operands, lead="norm"):
        # the gated layers (plain's shape, timed behind the norm): any time, slower
        if tuple(operands[0][0].shape) == plain and isinstance(fn, functools.partial):
            return 20.0
        return timer(fn, x, operands, lead)

    made, made_normed = [], []

    def kernel(*tile, swiglu=False):
        made.append(tile)
        return kernel_for(*tile, swiglu=swiglu)

    def normed_kernel(*tile, swiglu=False):
        made_normed.append(tile)
        return normed_kernel_for(*tile, swiglu=swiglu)

    choices = tune_one_row_linears(net, timer_for, lambda k: [tile, preload], kernel,
                                   make_normed_kernel=normed_kernel, gemv_runs=(2, 4))
    choice = next(c for c in choices if c.shape == qkv and c.normed)
    assert choice.tile == runs2 and choice.norm_inside and choice.best_us == 5.0
    assert "runs of blocks for 2 programs an SM" in choice.describe()
    for runs in (runs2, runs4):
        assert runs in made and runs in made_normed
    assert (*tile, 2) not in made + made_normed  # tile: not over the whole of K
    plain_choice = next(c for c in choices if c.shape == plain and not c.gated)
    assert plain_choice.tile == runs4 and not plain_choice.norm_inside
    norm = RMSNorm(8)
    one = torch.randn(1, 8)
    out, _ = net.qkv.normed(norm, one, None)
    torch.testing.assert_close(out, F.linear(rms_norm_ref(one, norm.weight, 1e-6),
                                             net.qkv.weight) + 3000.0)
    torch.testing.assert_close(net.plain(one), F.linear(one, net.plain.weight) + 1000.0)
    assert net.plain.small_m_kernels[1].tile == runs4


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
    def kernel(x, qweight, qzeros, scales, group_size, swiglu=False):
        y = awq_linear_ref(x, qweight, qzeros, scales, group_size)
        return (silu_and_mul(y) + 2000.0) if swiglu else y + 1000.0

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


def test_awq_gate_up_swiglu_runs_in_the_tuned_kernel():
    # an AWQ gate/up layer's SwiGLU goes into its one-row kernel (swiglu=True); other rows off
    # the GPU take the reference and SwiGLU after it
    layer = GateUpParallelLinear(32, 8, quant=AwqConfig(group_size=16))
    qweight, qzeros, scales = awq_tensors(32, 16, 16, "cpu", seed=3)
    layer.qweight.data, layer.qzeros.data, layer.scales.data = qweight, qzeros, scales.float()
    layer.small_m_kernels[1] = awq_kernel_for(1024, 8, 8, 3)
    args = (qweight, qzeros, scales.float(), 16)
    one, two = torch.randn(1, 32), torch.randn(2, 32)
    assert torch.allclose(layer.swiglu(one), silu_and_mul(awq_linear_ref(one, *args)) + 2000.0)
    assert torch.allclose(layer.swiglu(two), silu_and_mul(awq_linear_ref(two, *args)))


def test_awq_gate_up_layers_are_timed_with_swiglu_inside():
    """An AWQ gate/up layer runs with SwiGLU where its kernel adds the splits (layer.swiglu),
    so the tuning times every kernel so, and the winner serves layer.swiglu's one-row calls."""
    layer = GateUpParallelLinear(32, 8, quant=AwqConfig(group_size=16))
    qweight, qzeros, scales = awq_tensors(32, 16, 16, "cpu", seed=4)
    layer.qweight.data, layer.qzeros.data, layer.scales.data = qweight, qzeros, scales.float()
    tiles = [(1024, 8, 8, 3), (512, 16, 16, 3)]
    inside = ("_matmul_with_swiglu",)
    # keyed by qweight's shape [K, N / 8]; a kernel timed without SwiGLU is a KeyError
    times = {((32, 2), ("cublas", inside)): 10.0, ((32, 2), (tiles[0], inside)): 9.5,
             ((32, 2), (tiles[1], inside)): 8.0}
    timer, _ = fake_timer(times)
    (choice,) = tune_one_row_linears(torch.nn.ModuleDict({"g": layer}), timer, lambda k: (),
                                     kernel_for, tiles, awq_kernel_for)
    assert choice.gated and choice.tile == tiles[1] and choice.best_us == 8.0
    assert "AWQ 16x32 group 16 + SwiGLU (1 layers): awq_gemv 10.0 us -> awq_gemv 16x512" \
        in choice.describe()
    args = (qweight, qzeros, scales.float(), 16)
    one = torch.randn(1, 32)
    torch.testing.assert_close(layer.swiglu(one),
                               silu_and_mul(awq_linear_ref(one, *args)) + 2000.0)


def test_repacked_awq_layers_take_faster_tensor_core_settings_by_shape():
    """Layers in the tensor-core layout (repacked here on the CPU, as use_awq_tensor_cores does
    on a GPU) are timed against awq_mma_linear's default, over the settings whose columns a
    program divide N; the winner runs one-row inputs, other rows the default path."""
    from echo_kernels.awq_mma import awq_dequantize_repacked, repack_awq

    group = AwqConfig(group_size=64)
    layers = {n: ColumnParallelLinear(128, n, quant=group) for n in (128, 256)}
    original = {}
    for seed, (n, layer) in enumerate(layers.items()):
        qweight, qzeros, scales = awq_tensors(128, n, 64, "cpu", seed)
        original[n] = (qweight, qzeros, scales.float(), 64)
        layer.qweight = torch.nn.Parameter(repack_awq(qweight, 64), requires_grad=False)
        layer.qzeros.data, layer.scales.data = qzeros, scales.float()
        layer.awq_repacked = True
    net = torch.nn.ModuleDict({str(n): layer for n, layer in layers.items()})

    def mma_kernel_for(*tile):
        def kernel(x, rq, qzeros, scales, group_size, arrivals=None, swiglu=False):
            dense = awq_dequantize_repacked(rq, qzeros, scales, group_size, x.dtype)
            return x @ dense.t() + 1000.0

        kernel.tile = tile
        return kernel

    small, wide = (4, 1, 4, 1), (4, 4, 8, 2)  # 256 columns a program: N = 128 cannot take it
    # keyed by the repacked qweight's shape [N / 16, K / 64, 32, 4]
    times = {((8, 2, 32, 4), "cublas"): 10.0, ((8, 2, 32, 4), small): 10.0 / 1.02,
             ((16, 2, 32, 4), "cublas"): 10.0, ((16, 2, 32, 4), small): 9.5,
             ((16, 2, 32, 4), wide): 8.0}
    timer, _ = fake_timer(times)
    choices = tune_one_row_linears(net, timer, mma_candidates=[small, wide],
                                   make_mma_kernel=mma_kernel_for)
    by_shape = {c.shape: c for c in choices}
    assert by_shape[(128, 128)].tile is None  # 2% faster: the default stays
    won = by_shape[(256, 128)]
    assert won.repacked and won.tile == wide and won.best_us == 8.0
    assert "AWQ 256x128 group 64 (1 layers): awq_mma 10.0 us -> awq_mma 4 warps x 4 tiles 8 " \
        "programs an SM 2 ahead 8.0 us" in won.describe()
    one, two = torch.randn(1, 128), torch.randn(2, 128)
    torch.testing.assert_close(layers[256](one), awq_linear_ref(one, *original[256]) + 1000.0)
    for n in (128, 256):  # two rows, and the untuned shape: the repacked layout's default path
        torch.testing.assert_close(layers[n](two), awq_linear_ref(two, *original[n]))
    assert layers[128].small_m_kernels == {}


@pytest.mark.gpu
def test_gpu_tuning_with_real_timings_keeps_outputs(monkeypatch, tiny_llama):
    from echo import LLM, SamplingParams
    from echo.worker.linear_tuning import cuda_graph_timer
    from tests.entrypoints.test_llm import PROMPTS
    from tests.worker.test_gpu_runner import gpu_llm

    net = Net().cuda().to(torch.bfloat16)
    choices = tune_one_row_linears(net, cuda_graph_timer)
    # (a layer this small may hide wholly behind the kernel timed before it: 0 us)
    assert all(c.baseline_us >= 0 and c.best_us <= c.baseline_us for c in choices)
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
