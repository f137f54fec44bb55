"""Pick, per linear-layer shape, the faster of cuBLAS and echo's GEMV for one-row decode steps.

At batch 1 a linear layer is a read of its weight, and cuBLAS streams the small decode shapes
well below the H200's bandwidth (docs/benchmarks.md, History e20d1fd). `small_m_linear` beats it
on some shapes and loses on others, by amounts that depend on the card and the shape, so the
runner measures instead of guessing: for each distinct (N, K) it times F.linear and a few GEMV
tiles over all the layers of that shape (the weights a decode step really streams, past the L2)
and gives those layers the GEMV only where it is faster by a margin. On by default on CUDA
(ECHO_TUNE_SMALL_M=0 turns it off): with PDL it made batch-1 Llama-3.1-8B and Qwen3-8B steps
faster on an H200 (docs/benchmarks.md, History 6340cc9). The choice is per machine, so logits
may differ in the last bits between machines, as they do between cuBLAS versions.
"""

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from echo.layers.linear import LinearBase

# (block_n, block_k, prefetch, num_warps): the fastest tiles of bench_kernels.py's sweeps on an
# H200, for Llama-3.1-8B and Qwen3-8B (TP=1 and 2) shapes. Warps other than 4 won on the small
# shapes: Qwen3-8B qkv, TP=2 qkv and TP=2 o_proj (docs/benchmarks.md, Kernels).
GEMV_CANDIDATES = ((8, 512, False, 4), (8, 512, True, 4), (4, 512, False, 4), (4, 512, True, 4),
                   (4, 1024, False, 4), (16, 256, False, 4), (4, 512, False, 2),
                   (4, 512, True, 2), (4, 512, True, 8))
MIN_GAIN = 1.03  # the GEMV must be at least 3% faster: noise must not flip a choice

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# times one call of `fn(x, w)` per weight in `weights`, in microseconds per call
Timer = Callable[[Matmul, torch.Tensor, list[torch.Tensor]], float]


@dataclass(frozen=True)
class ShapeChoice:
    shape: tuple[int, int]  # (N, K)
    num_layers: int
    cublas_us: float
    best_us: float
    tile: tuple[int, int, bool, int] | None  # a GEMV_CANDIDATES entry; None: cuBLAS stays

    def describe(self) -> str:
        n, k = self.shape
        pick = "cuBLAS"
        if self.tile:
            block_n, block_k, prefetch, num_warps = self.tile
            pick = (f"small_m_linear {block_n}x{block_k}{' prefetch' if prefetch else ''} "
                    f"{num_warps} warps {self.best_us:.1f} us")
        return f"{n}x{k} ({self.num_layers} layers): cuBLAS {self.cublas_us:.1f} us -> {pick}"


def gemv(block_n: int, block_k: int, prefetch: bool, num_warps: int) -> Matmul:
    from echo_kernels.linear import small_m_linear

    return functools.partial(small_m_linear, block_n=block_n, block_k=block_k,
                             num_warps=num_warps, prefetch=prefetch)


def tune_one_row_linears(model: nn.Module, timer: Timer,
                         candidates: Sequence[tuple[int, int, bool, int]] = GEMV_CANDIDATES,
                         make_kernel: Callable[..., Matmul] = gemv) -> list[ShapeChoice]:
    """Set `small_m_kernels[1]` on every bias-free linear layer whose shape the GEMV wins."""
    by_shape: dict[tuple[int, int], list[LinearBase]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.bias is None and module.quant is None:
            by_shape[tuple(module.weight.shape)].append(module)
    choices = []
    for shape, layers in by_shape.items():
        weights = [layer.weight for layer in layers]
        x = torch.randn(1, shape[1], dtype=weights[0].dtype, device=weights[0].device)
        cublas_us = timer(F.linear, x, weights)
        best_us, best_tile = cublas_us / MIN_GAIN, None
        for tile in candidates:
            us = timer(make_kernel(*tile), x, weights)
            if us < best_us:
                best_us, best_tile = us, tile
        if best_tile is not None:
            kernel = make_kernel(*best_tile)
            for layer in layers:
                layer.small_m_kernels[1] = kernel
        choices.append(ShapeChoice(shape, len(layers), cublas_us,
                                   best_us if best_tile else cublas_us, best_tile))
    return choices


def cuda_graph_timer(fn: Matmul, x: torch.Tensor, weights: list[torch.Tensor],
                     replays: int = 10) -> float:
    """Median time per call of fn(x, w) over `weights`, replayed from one CUDA graph (launch
    overhead out, as in the engine's decode graphs)."""
    fn(x, weights[0])  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]
