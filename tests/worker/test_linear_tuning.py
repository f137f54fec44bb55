"""tune_one_row_linears: per shape, the GEMV replaces cuBLAS only where it is timed faster by
the margin, and a tuned layer then uses it for one-row inputs only."""

import pytest
import torch
import torch.nn.functional as F

from echo.distributed.parallel_state import SINGLE
from echo.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from echo.worker.linear_tuning import MIN_GAIN, tune_one_row_linears


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a1 = ColumnParallelLinear(8, 16)  # shape (16, 8), twice: one choice for both
        self.a2 = ColumnParallelLinear(8, 16)
        self.b = RowParallelLinear(16, 8)  # shape (8, 16)
        self.c = ReplicatedLinear(8, 4, True, SINGLE)  # a bias: never tuned
        for p in self.parameters():
            p.data.normal_()


def kernel_for(*tile):
    def kernel(x, w):  # a stand-in GEMV: recognizable output, same shape
        return F.linear(x, w) + 1000.0

    kernel.tile = tile
    return kernel


def fake_timer(times):
    """Times by (shape, tile or 'cublas'); records which weights each call streamed."""
    seen = []

    def timer(fn, x, weights):
        seen.append((tuple(weights[0].shape), len(weights)))
        assert x.shape == (1, weights[0].shape[1])
        return times[(tuple(weights[0].shape), getattr(fn, "tile", "cublas"))]

    return timer, seen


def test_faster_tiles_replace_cublas_only_beyond_the_margin():
    net = Net()
    tiles = [(8, 512, False, 4), (4, 1024, True, 2)]
    times = {((16, 8), "cublas"): 10.0, ((16, 8), tiles[0]): 9.0, ((16, 8), tiles[1]): 8.0,
             # 2% faster: inside the margin, cuBLAS stays
             ((8, 16), "cublas"): 10.0, ((8, 16), tiles[0]): 10.0 / 1.02,
             ((8, 16), tiles[1]): 11.0}
    timer, seen = fake_timer(times)
    choices = {c.shape: c for c in tune_one_row_linears(net, timer, tiles, kernel_for)}
    assert MIN_GAIN > 1.02
    assert set(choices) == {(16, 8), (8, 16)}  # the biased layer was not timed
    assert choices[(16, 8)].tile == tiles[1] and choices[(16, 8)].best_us == 8.0
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


@pytest.mark.gpu
def test_gpu_tuning_with_real_timings_keeps_outputs(monkeypatch, tiny_llama):
    from echo import LLM, SamplingParams
    from echo.worker.linear_tuning import cuda_graph_timer
    from tests.entrypoints.test_llm import PROMPTS
    from tests.worker.test_gpu_runner import gpu_llm

    net = Net().cuda().to(torch.bfloat16)
    choices = tune_one_row_linears(net, cuda_graph_timer)
    assert all(c.cublas_us > 0 and c.best_us <= c.cublas_us for c in choices)
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
