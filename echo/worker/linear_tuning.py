"""Pick, per linear-layer shape, the fastest kernel for one-row decode steps.

At batch 1 a linear layer is a read of its weight, and cuBLAS streams the small decode shapes
well below the H200's bandwidth (docs/benchmarks.md, History e20d1fd). `small_m_linear` beats it
on some shapes and loses on others, by amounts that depend on the card and the shape, so the
runner measures instead of guessing: for each distinct (N, K) it times F.linear and a few GEMV
tiles over all the layers of that shape (the weights a decode step really streams, past the L2)
and gives those layers the GEMV only where it is faster by a margin. AWQ layers get the same
treatment with awq_gemv's default tiles in cuBLAS's place and a few other tiles as the
candidates, per (N, K, group size); layers repacked for the tensor cores with awq_mma_gemv's
defaults against a few other settings. Where a layer's neighbours can move into its kernel, the
tiles that do so are timed too: SwiGLU after gate/up, and the RMSNorm before qkv, gate/up and
a mixture of experts' router (one rank), each against the separate launches (AWQ gate/up
layers, whose kernels always apply SwiGLU where they add their splits, are timed so). Every time is
taken behind the kernel that precedes such a layer in a decode step (cuda_graph_timer's lead),
since a GEMV that loads its weight before the PDL wait gains only behind a short one. On by
default on CUDA (ECHO_TUNE_SMALL_M=0 turns it off): with PDL it made batch-1 Llama-3.1-8B and
Qwen3-8B steps faster on an H200 (docs/benchmarks.md, History 6340cc9). The choice is per
machine, so logits may differ in the last bits between machines, as they do between cuBLAS
versions.
"""

import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from echo.layers.activation import silu_and_mul
from echo.layers.linear import GateUpParallelLinear, LinearBase

# (block_n, block_k, prefetch, num_warps): the fastest tiles of bench_kernels.py's sweeps on an
# H200, for Llama-3.1-8B and Qwen3-8B (TP=1 and 2) shapes. Warps other than 4 won on the small
# shapes: Qwen3-8B qkv, TP=2 qkv and TP=2 o_proj (docs/benchmarks.md, Kernels).
GEMV_CANDIDATES = ((8, 512, False, 4), (8, 512, True, 4), (4, 512, False, 4), (4, 512, True, 4),
                   (4, 1024, False, 4), (16, 256, False, 4), (4, 512, False, 2),
                   (4, 512, True, 2), (4, 512, True, 8))
# (block_n, block_k, programs_per_sm, num_stages) of awq_gemv, one warp: its sweep at
# Llama-3.1-8B's layers put every layer's best at one warp, 512-1024 columns, 8-16 rows a step
# and 8-16 programs an SM (docs/benchmarks.md AWQ, 090b1e5); the default is 512, 8, 8, 3
AWQ_GEMV_CANDIDATES = ((1024, 8, 8, 3), (512, 16, 8, 3), (1024, 16, 8, 3), (512, 8, 16, 3),
                       (1024, 8, 16, 3), (512, 16, 16, 3), (512, 8, 4, 3), (512, 8, 8, 5))
# (warps, 16-column tiles a warp, programs an SM, groups of weights in flight ahead) of
# awq_mma_gemv beside its default (4, 1, 8, 1): the probe's next best at one row on an H100
# (docs/benchmarks.md AWQ, 2026-12-06), with one group ahead and with two
AWQ_MMA_CANDIDATES = ((4, 1, 8, 2), (4, 1, 4, 1), (4, 1, 16, 2), (4, 2, 4, 1), (4, 2, 4, 2),
                      (4, 2, 8, 2), (8, 1, 8, 2))
MIN_GAIN = 1.03  # a candidate must be at least 3% faster: noise must not flip a choice
# A tile over the whole of K with prefetch loads a program's entire share of the weight before
# the PDL wait, while the short kernel before it (a norm, the split merge, SwiGLU) still runs:
# at small models' layers (4-12 MB) the load is most of a GEMV's time. Elements a share holds
# at most, by warps: 4K, 8K and 16K bf16 weights are 32 registers a thread, beside the float32
# accumulator's 64. Two warps: the whole-K twin of the tile that won qkv at Qwen3-0.6B and
# Qwen3-30B-A3B (4 x 512 on 2 warps, 2026-12-07, H100), where the 4- and 8-warp tiles with the
# norm inside lost to the norm's own launch (the norm inside needs a tile over the whole of K).
PRELOAD_SHARES = ((4096, 2), (8192, 4), (16384, 8))
# programs an SM for the tiles over the whole of K whose programs take runs of blocks, x (and
# the norm inside) once a program (ECHO_GEMV_RUNS=0 leaves them out). Llama-3.1-8B's qkv with
# the norm inside read 50 MB at 74% of an H100's copy rate a block a program (22.6 us: 3,072
# programs of 204 registers, offline sm_90, two an SM at a time, each with its own norm after
# the PDL wait); with runs for 4 programs an SM (251 registers) 21.9 us, the step 0.4% faster
# (docs/benchmarks.md, 2026-12-07 late).
RUN_PROGRAMS = (1, 2, 4)

# a linear layer's operands after x: (weight,), or (qweight, qzeros, scales, group_size)
Operands = tuple
Matmul = Callable[..., torch.Tensor]  # fn(x, *operands)
# times one call of `fn(x, *operands)` per layer's operands, in microseconds per call, behind
# the kernel that comes before such a layer in a decode step (cuda_graph_timer's lead: "gemv"
# for layers timed with the norm before them, else "norm", a short kernel)
Timer = Callable[..., float]  # timer(fn, x, operands, lead="norm")


@dataclass(frozen=True)
class ShapeChoice:
    shape: tuple[int, int]  # (N, K)
    num_layers: int
    baseline_us: float  # cuBLAS, or the AWQ kernel's defaults for AWQ layers
    best_us: float
    tile: tuple | None  # a candidate; None: the baseline stays
    awq_group: int | None = None  # the group size of AWQ layers
    gated: bool = False  # gate/up layers, timed with SwiGLU after them (AWQ: inside)
    swiglu: bool = False  # the tile computes SwiGLU itself (swiglu_kernels)
    normed: bool = False  # layers timed with the RMSNorm before them
    norm_inside: bool = False  # the tile computes that norm itself (normed_kernels)
    repacked: bool = False  # AWQ layers in the tensor-core layout (awq_mma_gemv's settings)

    def describe(self) -> str:
        n, k = self.shape
        name, baseline, pick = f"{n}x{k}", "cuBLAS", "cuBLAS"
        if self.gated:
            name, baseline, pick = f"{n}x{k} + SwiGLU", "cuBLAS + SwiGLU", "cuBLAS + SwiGLU"
        if self.normed:
            name, baseline, pick = f"norm + {name}", f"norm + {baseline}", f"norm + {pick}"
        if self.awq_group is not None:
            kernel = "awq_mma" if self.repacked else "awq_gemv"
            name, baseline, pick = (f"AWQ {n}x{k} group {self.awq_group}"
                                    f"{' + SwiGLU' if self.gated else ''}", kernel, "default")
        if self.tile and self.repacked:
            warps, tiles, per_sm, ahead = self.tile
            pick = (f"awq_mma {warps} warps x {tiles} tiles {per_sm} programs an SM {ahead} "
                    f"ahead {self.best_us:.1f} us")
        elif self.tile and self.awq_group is None:
            block_n, block_k, prefetch, num_warps, *runs = self.tile
            pick = (f"small_m_linear {block_n}x{block_k}{' prefetch' if prefetch else ''} "
                    f"{num_warps} warps{', norm inside' if self.norm_inside else ''}"
                    f"{f', runs of blocks for {runs[0]} programs an SM' if runs else ''}"
                    f"{', SwiGLU inside' if self.swiglu else ''} "
                    f"{self.best_us:.1f} us")
        elif self.tile:
            block_n, block_k, per_sm, stages = self.tile
            pick = (f"awq_gemv {block_k}x{block_n} {per_sm} programs an SM {stages} stages "
                    f"{self.best_us:.1f} us")
        return (f"{name} ({self.num_layers} layers): {baseline} {self.baseline_us:.1f} us -> "
                f"{pick}")


def preload_tiles(k: int) -> tuple[tuple, ...]:
    """GEMV candidates whose one tile covers K (PRELOAD_SHARES), for layers of K inputs."""
    block_k = 1 << (k - 1).bit_length()
    return tuple((elements // block_k, block_k, True, warps)
                 for elements, warps in PRELOAD_SHARES if elements // block_k >= 2)


def gemv_candidates(k: int) -> tuple[tuple, ...]:
    """The GEMV tiles timed for a layer of K inputs."""
    return GEMV_CANDIDATES + tuple(t for t in preload_tiles(k) if t not in GEMV_CANDIDATES)


def gemv(block_n: int, block_k: int, prefetch: bool, num_warps: int,
         programs_per_sm: int | None = None, swiglu: bool = False) -> Matmul:
    """small_m_linear with a tile, and with programs_per_sm (a tile over the whole of K) its
    programs taking runs of blocks."""
    from echo_kernels.linear import small_m_linear

    return functools.partial(small_m_linear, block_n=block_n, block_k=block_k,
                             num_warps=num_warps, prefetch=prefetch, swiglu=swiglu,
                             programs_per_sm=programs_per_sm)


def awq_gemv(block_n: int, block_k: int, programs_per_sm: int, num_stages: int) -> Matmul:
    from echo_kernels.awq import awq_gemv as kernel

    return functools.partial(kernel, block_n=block_n, block_k=block_k,
                             programs_per_sm=programs_per_sm, num_stages=num_stages)


def awq_default(x, qweight, qzeros, scales, group_size, swiglu=False) -> torch.Tensor:
    from echo_kernels.awq import awq_linear

    return awq_linear(x, qweight, qzeros, scales, group_size, swiglu=swiglu)


def awq_mma(warps: int, tiles: int, per_sm: int, ahead: int) -> Matmul:
    from echo_kernels.awq_mma import awq_mma_gemv

    return functools.partial(awq_mma_gemv, warps=warps, tiles=tiles, per_sm=per_sm,
                             ahead=ahead)


def awq_mma_default(x, rq, qzeros, scales, group_size, arrivals=None,
                    swiglu=False) -> torch.Tensor:
    from echo_kernels.awq_mma import awq_mma_linear

    return awq_mma_linear(x, rq, qzeros, scales, group_size, arrivals, swiglu)


def normed_gemv(block_n: int, block_k: int, prefetch: bool, num_warps: int,
                programs_per_sm: int | None = None, swiglu: bool = False) -> Callable:
    """small_m_normed_linear with a preload tile's rows and warps (its tile covers K), and with
    programs_per_sm its programs taking runs of blocks."""
    from echo_kernels.linear import small_m_normed_linear

    return functools.partial(small_m_normed_linear, block_n=block_n, num_warps=num_warps,
                             swiglu=swiglu, programs_per_sm=programs_per_sm)


@dataclass(frozen=True)
class _Run:
    """One way to compute a layer at one row, as the tuning times it."""

    fn: Matmul  # fn(x, *operands)
    tile: tuple | None = None  # None: the baseline
    swiglu: bool = False  # SwiGLU inside the kernel
    normed: bool = False  # the norm before the layer inside the kernel


def tune_one_row_linears(model: nn.Module, timer: Timer,
                         candidates: Callable[[int], Sequence[tuple]] = gemv_candidates,
                         make_kernel: Callable[..., Matmul] = gemv,
                         awq_candidates: Sequence[tuple] = AWQ_GEMV_CANDIDATES,
                         make_awq_kernel: Callable[..., Matmul] = awq_gemv,
                         make_normed_kernel: Callable[..., Callable] = normed_gemv,
                         mma_candidates: Sequence[tuple] = AWQ_MMA_CANDIDATES,
                         make_mma_kernel: Callable[..., Matmul] = awq_mma,
                         gemv_runs: Sequence[int] = (),
                         ) -> list[ShapeChoice]:
    """Set `small_m_kernels[1]` on every bias-free linear layer whose shape a candidate wins
    by MIN_GAIN over the baseline (cuBLAS; awq_linear's default for AWQ layers, awq_mma_linear's
    for those repacked for the tensor cores, against awq_mma_gemv's settings). Dense gate/up
    layers are timed with SwiGLU after them, against the same tiles with SwiGLU inside
    (`make_kernel(*tile, swiglu=True)`, to `swiglu_kernels[1]`). Dense layers of one rank that
    follow a norm (qkv, gate/up, a router: `follows_norm`) are timed with the RMSNorm before
    them (LinearBase.normed), against the tiles over the whole of K with the norm inside
    (`make_normed_kernel(*tile, swiglu=gated)`, to `normed_kernels[1]`). Each dense tile over
    the whole of K is timed again with its programs taking runs of blocks for each count of
    programs an SM in gemv_runs (the tile gains that count as a fifth field)."""
    by_shape: dict[tuple, list[LinearBase]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.bias is None:
            dense = module.quant is None
            gated = isinstance(module, GateUpParallelLinear)
            normed = dense and module.tp.size == 1 and module.follows_norm
            by_shape[(*_shape(module), gated, normed, module.awq_repacked)].append(module)
    choices = []
    for (n, k, group, gated, normed, repacked), layers in by_shape.items():
        operands = [_operands(layer) for layer in layers]
        like = operands[0][0] if group is None else operands[0][2]  # weight or scales
        x = torch.randn(1, k, dtype=like.dtype, device=like.device)
        if group is None:
            baseline, tiles, make = F.linear, list(candidates(k)), make_kernel
            tiles += [(*tile, programs) for tile in tiles if _whole_k(tile, k)
                      for programs in gemv_runs]
        elif repacked:  # a program's columns must divide N
            baseline, make = awq_mma_default, make_mma_kernel
            tiles = [tile for tile in mma_candidates if n % (16 * tile[0] * tile[1]) == 0]
        else:  # awq_gemv's block_k must divide the group
            baseline, make = awq_default, make_awq_kernel
            tiles = [tile for tile in awq_candidates if group % tile[1] == 0]
        runs = [_Run(baseline), *(_Run(make(*tile), tile) for tile in tiles)]
        if gated and group is None:
            runs = [_Run(_then_swiglu(run.fn), run.tile) for run in runs]
            runs += [_Run(make(*tile, swiglu=True), tile, swiglu=True) for tile in tiles]
        elif gated:  # an AWQ kernel applies SwiGLU where it adds its splits, as the layer asks
            runs = [_Run(_with_swiglu(run.fn), run.tile) for run in runs]
        if normed:
            norm = (torch.randn_like(x), torch.ones(k, dtype=x.dtype, device=x.device), 1e-6)
            runs = [_Run(_after_norm(norm, run.fn), run.tile, run.swiglu) for run in runs]
            runs += [_Run(functools.partial(_normed_call, norm,
                                            make_normed_kernel(*tile, swiglu=gated)),
                          tile, gated, normed=True) for tile in tiles if _whole_k(tile, k)]
        lead = "gemv" if normed else "norm"
        baseline_us = timer(runs[0].fn, x, operands, lead=lead)
        best_us, best = baseline_us / MIN_GAIN, None
        for run in runs[1:]:
            us = timer(run.fn, x, operands, lead=lead)
            if us < best_us:
                best_us, best = us, run
        for layer in layers if best is not None else []:
            if best.normed:  # where the layer's caller goes through LinearBase.normed
                layer.normed_kernels[1] = make_normed_kernel(*best.tile, swiglu=gated)
            elif best.swiglu:
                layer.swiglu_kernels[1] = make(*best.tile, swiglu=True)
            else:
                layer.small_m_kernels[1] = make(*best.tile)
        choices.append(ShapeChoice((n, k), len(layers), baseline_us,
                                   best_us if best else baseline_us, best and best.tile, group,
                                   gated, bool(best and best.swiglu), normed,
                                   bool(best and best.normed), repacked))
    return choices


def _whole_k(tile: tuple, k: int) -> bool:
    """Whether a GEMV tile loads its program's whole share before the PDL wait (the norm
    inside needs all of a row at once)."""
    _, block_k, prefetch, *_ = tile
    return prefetch and block_k >= k


def _with_swiglu(matmul: Matmul) -> Matmul:
    """An AWQ matmul asked for SwiGLU of its halves (a partial: its first argument is the
    matmul)."""
    return functools.partial(_matmul_with_swiglu, matmul)


def _matmul_with_swiglu(matmul: Matmul, x: torch.Tensor, *operands) -> torch.Tensor:
    return matmul(x, *operands, swiglu=True)


def _then_swiglu(matmul: Matmul) -> Matmul:
    """matmul, then SwiGLU's own launch (a partial: its first argument is the matmul)."""
    return functools.partial(_matmul_then_swiglu, matmul)


def _matmul_then_swiglu(matmul: Matmul, x: torch.Tensor, *operands) -> torch.Tensor:
    return silu_and_mul(matmul(x, *operands))


def _after_norm(norm: tuple, matmul: Matmul) -> Matmul:
    """The add + RMSNorm launch (norm: its residual, weight and eps), then matmul (a partial:
    its second argument is the matmul)."""
    return functools.partial(_norm_then_matmul, norm, matmul)


def _norm_then_matmul(norm: tuple, matmul: Matmul, x: torch.Tensor, *operands):
    from echo_kernels import fused_add_rms_norm

    residual, weight, eps = norm
    x, _ = fused_add_rms_norm(x, residual, weight, eps)
    return matmul(x, *operands)


def _normed_call(norm: tuple, kernel: Callable, x: torch.Tensor, weight: torch.Tensor):
    residual, norm_weight, eps = norm
    return kernel(x, residual, norm_weight, eps, weight)[0]


def _shape(layer: LinearBase) -> tuple[int, int, int | None]:
    """(N, K, the AWQ group size or None)."""
    if layer.quant is None:
        return (*layer.weight.shape, None)
    # from the zeros [K / group, N / 8], whichever layout qweight is in
    group = layer.quant.group_size
    return layer.scales.shape[1], layer.qzeros.shape[0] * group, group


def _operands(layer: LinearBase) -> Operands:
    if layer.quant is None:
        return (layer.weight,)
    return layer.awq_operands()


def cuda_graph_timer(fn: Matmul, x: torch.Tensor, operands: list[Operands],
                     replays: int = 10, lead: str = "norm") -> float:
    """Median time per call of fn(x', *each layer's operands), replayed from one CUDA graph
    (launch overhead out, as in the engine's decode graphs), where x' comes from a `lead`
    kernel launched just before, whose own time is taken off: "norm", a short one (an
    RMSNorm: before most one-row layers of a decode step runs a norm, the split merge or
    SwiGLU); "gemv" (the layer before a norm); "none": x itself, nothing before. A tile that
    loads its weight before the PDL wait gains only behind a short kernel, while a GEMV holds
    the SMs."""
    if lead == "gemv":
        from echo_kernels.linear import small_m_linear

        square = torch.randn(x.shape[-1], x.shape[-1], dtype=x.dtype, device=x.device)

        def before():
            return small_m_linear(x, square)
    elif lead == "norm":
        from echo_kernels.norm import rms_norm

        ones = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)

        def before():
            return rms_norm(x, ones, 1e-6)
    elif lead == "none":
        def before():
            return x
    else:
        raise ValueError(f"cuda_graph_timer: lead {lead!r} is not gemv, norm or none")

    fn(before(), *operands[0])  # compile before capture
    with_fn = _graph_us([lambda ops=ops: fn(before(), *ops) for ops in operands], replays)
    before_alone = 0.0 if lead == "none" else _graph_us([before] * len(operands), replays)
    # a tiny layer may hide wholly behind the lead: its share is nothing, not less
    return max(with_fn - before_alone, 0.0) / len(operands)


def _graph_us(calls: list[Callable[[], object]], replays: int) -> float:
    """Median µs of one replay of a CUDA graph of the calls in order."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]
