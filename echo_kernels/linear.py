"""Linear layers for a few rows (decode at batch 1-4): y[M, N] = x[M, K] @ w[N, K]^T.

At a few rows a linear layer is a pure read of its weight, so the kernel's only job is to stream
w at the memory's bandwidth. Tensor cores would pad M to 16 and stage every tile through shared
memory for nothing; here each program owns BLOCK_N output features over the whole K, multiplies
its weight tiles by x on the CUDA cores into an fp32 [M, BLOCK_N, BLOCK_K] accumulator and
reduces over K once at the end. One launch, no atomics, no split-K partials: deterministic.

The RMSNorm between two GEMVs can be handed over instead of launched: a row-parallel layer's
GEMV (o_proj, down) adds its outputs into the residual stream and stores each program's sum of
squares of the new stream (`small_m_linear_into`); the next GEMV (qkv, gate/up) reads the
stream, multiplies it by the norm's weight as it loads it, and scales its sums by 1/rms from
those parts (`small_m_prenormed_linear`). No launch for the norm, and the consumer's tiles need
not cover K, as the norm inside one (`small_m_normed_linear`) must.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from echo_kernels.activation import silu_times
from echo_kernels.device import sm_count
from echo_kernels.moe_route import route_row
from echo_kernels.norm import apply_rms
from echo_kernels.pdl import pdl_options, wait_for_inputs

MAX_ROWS = 4  # beyond this the accumulator outgrows the registers: cuBLAS is the better choice


@triton.jit
def weight_tile(w_ptrs, cols, offs_k, k0, N, K, UNMASKED: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of a row-major [N, K] weight at rows `cols`, columns k0 +
    offs_k (w_ptrs: those of k0 = 0); zeros past N and K unless UNMASKED (also fused_moe's)."""
    if UNMASKED:
        return tl.load(w_ptrs + k0)
    return tl.load(w_ptrs + k0, mask=(cols[:, None] < N) & (k0 + offs_k[None, :] < K), other=0.0)


@triton.jit
def _row_ptrs(w_ptr, cols, offs_k, stride_wn):
    """[BLOCK_N, BLOCK_K] pointers to the weight rows `cols` at columns offs_k."""
    return w_ptr + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]


@triton.jit
def _store_outputs(y, out_ptr, rows, outs, M, N_OUT, stride_om, SWIGLU: tl.constexpr):
    """y [M_PAD, BLOCK_N] float32 sums into out[rows, outs]. SWIGLU: y's columns are the gate
    rows, then the up rows of the same outputs; silu(gate) * up is stored, rounded as the
    separate launches round (gate and up stored in the output dtype, silu's result too)."""
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    if SWIGLU:
        M_PAD: tl.constexpr = y.shape[0]
        HALF: tl.constexpr = y.shape[1] // 2
        gate, up = tl.split(tl.permute(tl.reshape(y.to(dtype), [M_PAD, 2, HALF]), (0, 2, 1)))
        y = silu_times(gate, up)
    out = out_ptr + rows[:, None] * stride_om + outs[None, :]
    tl.store(out, y.to(dtype), mask=(rows[:, None] < M) & (outs[None, :] < N_OUT))


@triton.jit
def _block_residual(add_ptr, rows, outs, M, N_OUT, stride_om):
    """The residual stream's values at the outputs of a block, [M_PAD, BLOCK_N] (zeros past
    M and N): loaded early, before the block's product needs them."""
    return tl.load(add_ptr + rows[:, None] * stride_om + outs[None, :],
                   mask=(rows[:, None] < M) & (outs[None, :] < N_OUT), other=0.0)


@triton.jit
def _add_outputs(y, r, add_ptr, rows, outs, M, N_OUT, stride_om):
    """Store r + y (y [M_PAD, BLOCK_N] float32 sums, r the stream's values there) into the
    stream, rounded as fused_add_rms_norm rounds its sum (y first to the output dtype, as the
    layer's own output would be); returns each row's sum of squares of what was stored."""
    dtype: tl.constexpr = add_ptr.dtype.element_ty
    s = (y.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(add_ptr + rows[:, None] * stride_om + outs[None, :], s,
             mask=(rows[:, None] < M) & (outs[None, :] < N_OUT))
    sf = s.to(tl.float32)
    return tl.sum(sf * sf, axis=1)


@triton.jit
def _rstd_from_parts(parts_ptr, rows, M, num_parts, K, eps, BLOCK_P: tl.constexpr):
    """1 / rms of each row [M_PAD] from the parts of its sum of squares ([M, num_parts]
    float32, small_m_linear_into's)."""
    offs_p = tl.arange(0, BLOCK_P)
    parts = tl.load(parts_ptr + rows[:, None] * num_parts + offs_p[None, :],
                    mask=(rows[:, None] < M) & (offs_p[None, :] < num_parts), other=0.0)
    return tl.math.rsqrt(tl.sum(parts, axis=1) / K + eps)


@triton.jit
def _route_when_last(logits_ptr, num_experts, arrivals_ptr, weights_ptr, ids_ptr, top_k,
                     RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_TOPK: tl.constexpr):
    """The launch's last program to arrive routes the row of logits the launch stored
    (moe_routing's rule: weights [top_k] float32 and expert ids int32) and zeroes the count
    for the next launch."""
    # every thread's stores before the arrival (the atomic releases them device-wide)
    tl.debug_barrier()
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        weights, ids = route_row(logits_ptr, num_experts, top_k, RENORMALIZE, BLOCK_E,
                                 BLOCK_TOPK)
        slots = tl.arange(0, BLOCK_TOPK)
        tl.store(weights_ptr + slots, weights, mask=slots < top_k)
        tl.store(ids_ptr + slots, ids, mask=slots < top_k)
        tl.store(arrivals_ptr, 0)


@triton.jit
def _block_columns(block, N, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr):
    """(the weight rows, the outputs) of output block `block`: SWIGLU, outputs j with their
    gate row j and up row N / 2 + j."""
    if SWIGLU:
        HALF: tl.constexpr = BLOCK_N // 2
        offs = tl.arange(0, BLOCK_N)
        j = block * HALF + offs % HALF
        cols = tl.where(offs < HALF, j, N // 2 + j)
        outs = block * HALF + tl.arange(0, HALF)
    else:
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        outs = cols
    return cols, outs


@triton.jit
def _normed_rows(x, rows, offs_k, x_ok, K, stride_xm, resid_ptr, sum_ptr, norm_w, eps,
                 HAS_RESIDUAL: tl.constexpr):
    """RMSNorm(x + residual) of the rows x [M_PAD, BLOCK_K], rounded as fused_add_rms_norm
    rounds it (norm.py); program 0 stores the sum."""
    if HAS_RESIDUAL:
        r = tl.load(resid_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=x_ok,
                    other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + rows[:, None] * stride_xm + offs_k[None, :], x, mask=x_ok)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
    return apply_rms(xf, rstd, norm_w[None, :], x.dtype)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    out_ptr,  # [M, N], or [M, N / 2] (SWIGLU)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,  # M rounded up to a power of two
    BLOCK_N: tl.constexpr,  # weight rows a program (SWIGLU: half gate, half up)
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no masks on the weight
    PREFETCH: tl.constexpr,  # load the next weight tile before using this one
    WHOLE_K: tl.constexpr,  # PREFETCH with BLOCK_K >= K: one tile, all of it before the wait
    SWIGLU: tl.constexpr,  # w is [gate; up] (N = 2d): store silu(x @ gate^T) * (x @ up^T)
    USE_PDL: tl.constexpr,  # echo_kernels.pdl: the first weight tile loads before the wait
    # RMSNorm(x + residual) in place of x (WHOLE_K only): every program normalises the rows
    # for itself, program 0 stores the sum x + residual (HAS_RESIDUAL; else x is the sum)
    NORM: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = False,
    resid_ptr=None,  # [M, K], stride stride_xm
    norm_w_ptr=None,  # [K]
    sum_ptr=None,  # [M, K], stride stride_xm
    eps=0.0,
    normed_ptr=None,  # [M, K], stride stride_xm: the normed rows, stored by program 0 if given
    # WHOLE_K: a program takes blocks_per_program output blocks one after another, the next
    # block's weight tile loading while this one's is summed (its x, normed, loaded once)
    RUNS: tl.constexpr = False,
    blocks_per_program=1,
    # ADD_INTO: the outputs are added into add_ptr [M, N] (stride stride_om) in place of a
    # store, and each program stores its rows' sums of squares of the new values to
    # parts_ptr[row, program] (the next RMSNorm's statistics, handed over)
    ADD_INTO: tl.constexpr = False,
    add_ptr=None,
    # PRENORM: x is the residual stream whose RMSNorm (weight norm_w_ptr, eps) is the layer's
    # input, with its sums of squares in num_parts parts at parts_ptr [M, num_parts]: x is
    # multiplied by the weight as it loads, the sums by 1 / rms at the end
    PRENORM: tl.constexpr = False,
    parts_ptr=None,
    num_parts=1,
    BLOCK_P: tl.constexpr = 1,
    # ROUTE (one row of a mixture of experts' router): the last program to arrive at
    # arrivals_ptr (an int32, zero between launches) routes the logits out_ptr holds then
    # (_route_when_last: top_k weights to route_w_ptr, expert ids to route_ids_ptr)
    ROUTE: tl.constexpr = False,
    arrivals_ptr=None,
    route_w_ptr=None,
    route_ids_ptr=None,
    top_k=1,
    RENORMALIZE: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1,
    BLOCK_TOPK: tl.constexpr = 1,
):
    tl.static_assert(WHOLE_K or not NORM, "the norm inside needs a tile over the whole of K")
    tl.static_assert(not (ADD_INTO and SWIGLU), "SwiGLU's outputs are no residual stream")
    tl.static_assert(not (NORM and PRENORM), "one norm: computed inside, or handed over")
    block = tl.program_id(0) * blocks_per_program if RUNS else tl.program_id(0)
    cols, outs = _block_columns(block, N, BLOCK_N, SWIGLU)
    n_out = N // 2 if SWIGLU else N
    rows = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = _row_ptrs(w_ptr, cols, offs_k, stride_wn)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :]
    ss = tl.zeros([M_PAD], dtype=tl.float32)  # ADD_INTO: the program's sums of squares
    if WHOLE_K:
        # one tile holds the program's whole share: it loads before the wait (while the short
        # kernel before still runs), and no second tile is held as the loop below holds one
        w = weight_tile(w_ptrs, cols, offs_k, 0, N, K, EVEN)
        x_ok = (rows[:, None] < M) & (offs_k[None, :] < K)
        if NORM or PRENORM:  # a weight too: loaded before the wait
            norm_w = tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0)
        wait_for_inputs(USE_PDL)
        x = tl.load(x_ptrs, mask=x_ok, other=0.0)
        if ADD_INTO:
            r = _block_residual(add_ptr, rows, outs, M, n_out, stride_om)
        if PRENORM:
            rstd = _rstd_from_parts(parts_ptr, rows, M, num_parts, K, eps, BLOCK_P)
            x = x.to(tl.float32) * norm_w.to(tl.float32)[None, :]
        if NORM:
            x = _normed_rows(x, rows, offs_k, x_ok, K, stride_xm, resid_ptr, sum_ptr, norm_w,
                             eps, HAS_RESIDUAL)
            if normed_ptr is not None:
                if tl.program_id(0) == 0:
                    tl.store(normed_ptr + rows[:, None] * stride_xm + offs_k[None, :], x,
                             mask=x_ok)
        if RUNS:
            for i in range(blocks_per_program):
                next_cols, next_outs = _block_columns(block + i + 1, N, BLOCK_N, SWIGLU)
                # past the run (or N) no row: the mask is all false and no memory is read
                next_cols = tl.where(i + 1 < blocks_per_program, next_cols, N)
                w_next = weight_tile(_row_ptrs(w_ptr, next_cols, offs_k, stride_wn), next_cols,
                                     offs_k, 0, N, K, False)
                if ADD_INTO:  # past the run (or N) nothing: the mask is all false
                    r_next = _block_residual(
                        add_ptr, rows, tl.where(i + 1 < blocks_per_program, next_outs, n_out),
                        M, n_out, stride_om)
                y = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
                if PRENORM:
                    y = y * rstd[:, None]
                if ADD_INTO:
                    ss += _add_outputs(y, r, add_ptr, rows, outs, M, n_out, stride_om)
                    r = r_next
                else:
                    _store_outputs(y, out_ptr, rows, outs, M, n_out, stride_om, SWIGLU)
                w = w_next
                outs = next_outs
        else:
            y = tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    else:
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
        # NOTE: Triton's software pipeliner stages loads that feed tl.dot; these feed CUDA-core
        # math, so PREFETCH double-buffers them in registers by hand to keep two tiles in flight
        if PREFETCH:
            # the weight is never written by a kernel: its first tile may load before the wait
            w_next = weight_tile(w_ptrs, cols, offs_k, 0, N, K, EVEN)
        wait_for_inputs(USE_PDL)
        if ADD_INTO:
            r = _block_residual(add_ptr, rows, outs, M, n_out, stride_om)
        if PRENORM:
            rstd = _rstd_from_parts(parts_ptr, rows, M, num_parts, K, eps, BLOCK_P)
        for k0 in range(0, K, BLOCK_K):
            if PREFETCH:
                w = w_next
                # past the last tile the mask is all false: no memory is read
                w_next = weight_tile(w_ptrs, cols, offs_k, k0 + BLOCK_K, N, K, False)
            else:
                w = weight_tile(w_ptrs, cols, offs_k, k0, N, K, EVEN)
            x_tile = tl.load(x_ptrs + k0,
                             mask=(rows[:, None] < M) & (k0 + offs_k[None, :] < K),
                             other=0.0).to(tl.float32)
            if PRENORM:
                x_tile = x_tile * tl.load(norm_w_ptr + k0 + offs_k, mask=k0 + offs_k < K,
                                          other=0.0).to(tl.float32)[None, :]
            acc += w.to(tl.float32)[None, :, :] * x_tile[:, None, :]
        y = tl.sum(acc, axis=2)
    if not (WHOLE_K and RUNS):  # one block's sums y (runs store theirs in their loop)
        if PRENORM:
            y = y * rstd[:, None]
        if ADD_INTO:
            ss += _add_outputs(y, r, add_ptr, rows, outs, M, n_out, stride_om)
        else:
            _store_outputs(y, out_ptr, rows, outs, M, n_out, stride_om, SWIGLU)
    if ADD_INTO:
        tl.store(parts_ptr + rows * tl.num_programs(0) + tl.program_id(0), ss, mask=rows < M)
    if ROUTE:
        _route_when_last(out_ptr, n_out, arrivals_ptr, route_w_ptr, route_ids_ptr, top_k,
                         RENORMALIZE, BLOCK_E, BLOCK_TOPK)


@dataclass(frozen=True)
class RouteInto:
    """Where a router's GEMV puts one token's routing, computed by its last program
    (moe_routing's rule): weights [1, top_k] float32, expert ids [1, top_k] int32; arrivals,
    an int32 count that is zero between launches (the last program zeroes it again);
    renormalize: the weights divided by their sum (Qwen3-MoE's norm_topk_prob)."""

    weights: torch.Tensor
    ids: torch.Tensor
    arrivals: torch.Tensor
    renormalize: bool


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None,
                   block_k: int | None = None, num_warps: int = 4,
                   num_stages: int = 3, prefetch: bool = False,
                   swiglu: bool = False, programs_per_sm: int | None = None,
                   route: RouteInto | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] -> [M, N] in x's dtype, fp32 accumulation.
    swiglu: weight is SwiGLU's [gate; up] and the result silu(x @ gate^T) * (x @ up^T),
    [M, N / 2], each program computing block_n / 2 outputs from their gate and up rows.
    programs_per_sm (a prefetched tile over the whole of K): a program takes a run of blocks,
    so that about that many programs an SM share them, x loaded once a program and the next
    block's weight loading while one is summed. route (one row): the result is a router's
    logits, and the launch routes them too (RouteInto)."""
    _check_shared_k(x, weight)
    return _launch("small_m_linear", x, weight, block_n or 8, block_k or _default_block_k(x),
                   prefetch, swiglu, num_warps, num_stages=num_stages,
                   programs_per_sm=programs_per_sm, route=route)


def _check_shared_k(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape[1] != x.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share a "
                         "contiguous K")


def _default_block_k(x: torch.Tensor) -> int:
    # NOTE: swept on an H200 at M=1 (bench_kernels.py --only linear --sweep): 8 x 512 tiles
    # were best at Llama-3.1-8B's qkv/o_proj/down shapes. The accumulator holds
    # M_PAD * BLOCK_N * BLOCK_K floats, so K per tile shrinks as M grows.
    return max(128, 512 // triton.next_power_of_2(x.shape[0]))


def small_m_normed_linear(x: torch.Tensor, residual: torch.Tensor | None,
                          norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          block_n: int, num_warps: int = 4, swiglu: bool = False,
                          normed_out: torch.Tensor | None = None,
                          programs_per_sm: int | None = None,
                          route: RouteInto | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """small_m_linear(RMSNorm(x + residual)) with the norm inside, one tile over the whole of
    K a block of block_n outputs: (its output, the sum x + residual, a new tensor; x itself
    when residual is None). The norm and the sum round as fused_add_rms_norm's do. normed_out
    (like x): where the normed rows go too, for other layers that read them. A program takes
    one block, or with programs_per_sm a run of blocks, so that about that many programs an
    SM share them: the norm once a program, and the next block's weight loading while one is
    summed. route: as small_m_linear's (a router with the norm before it inside)."""
    k = x.shape[1]
    if (weight.shape[1] != k or norm_weight.shape != (k,) or not x.is_contiguous()
            or weight.stride(1) != 1 or (residual is not None and residual.shape != x.shape)
            or (normed_out is not None and (normed_out.shape != x.shape
                                            or not normed_out.is_contiguous()))):
        raise ValueError(f"x {tuple(x.shape)}, residual, norm weight {tuple(norm_weight.shape)}"
                         f" and weight {tuple(weight.shape)} must share a contiguous K")
    total = x if residual is None else torch.empty_like(x)
    out = _launch("small_m_normed_linear", x, weight, block_n, triton.next_power_of_2(k), True,
                  swiglu, num_warps, NORM=True, HAS_RESIDUAL=residual is not None,
                  resid_ptr=x if residual is None else residual.contiguous(),
                  norm_w_ptr=norm_weight, sum_ptr=total, eps=eps, normed_ptr=normed_out,
                  programs_per_sm=programs_per_sm, route=route)
    return out, total


def small_m_linear_into(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                       block_n: int | None = None, block_k: int | None = None,
                       num_warps: int = 4, prefetch: bool = False,
                       programs_per_sm: int | None = None) -> torch.Tensor:
    """residual += small_m_linear(x, weight) in place (the product rounded to x's dtype, then
    the sum, as the layer's output and fused_add_rms_norm's add round them), in one launch
    with small_m_linear's tiles. Returns the sums of squares of residual's new rows in parts,
    [M, programs] float32, one a program: the next RMSNorm's statistics, for
    small_m_prenormed_linear."""
    _check_shared_k(x, weight)
    if (residual.shape != (x.shape[0], weight.shape[0]) or not residual.is_contiguous()
            or residual.dtype != x.dtype):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and residual "
                         f"{tuple(residual.shape)} must share a contiguous K, and the "
                         "residual be [M, N] of x's dtype")
    return _launch("small_m_linear_into", x, weight, block_n or 8,
                   block_k or _default_block_k(x), prefetch, False, num_warps,
                   programs_per_sm=programs_per_sm, into=residual)


def small_m_prenormed_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             parts: torch.Tensor, weight: torch.Tensor,
                             block_n: int | None = None, block_k: int | None = None,
                             num_warps: int = 4, prefetch: bool = False, swiglu: bool = False,
                             programs_per_sm: int | None = None) -> torch.Tensor:
    """small_m_linear(RMSNorm(x)) where small_m_linear_into left x, the residual stream, and
    parts [M, P] float32, its sums of squares: x times the norm's weight goes into the
    product, 1 / rms = rsqrt(sum(parts) / K + eps) scales its sums (swiglu: before SwiGLU).
    The normed row is not rounded to x's dtype on the way, as the norm's own launch rounds it:
    results agree with the norm then the linear to the dtype's precision, not bit for bit."""
    m, k = x.shape
    if (norm_weight.shape != (k,) or parts.dim() != 2 or parts.shape[0] != m
            or parts.dtype != torch.float32 or not parts.is_contiguous()):
        raise ValueError(f"x {tuple(x.shape)}, norm weight {tuple(norm_weight.shape)} and the "
                         f"parts {tuple(parts.shape)} ({parts.dtype}) do not fit: the parts are "
                         "[M, P] float32")
    _check_shared_k(x, weight)
    return _launch("small_m_prenormed_linear", x, weight, block_n or 8,
                   block_k or _default_block_k(x), prefetch, swiglu, num_warps,
                   programs_per_sm=programs_per_sm, PRENORM=True,
                   norm_w_ptr=norm_weight, eps=eps, parts_ptr=parts, num_parts=parts.shape[1],
                   BLOCK_P=triton.next_power_of_2(parts.shape[1]))


def _launch(name: str, x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int,
            prefetch: bool, swiglu: bool, num_warps: int, num_stages: int = 3,
            programs_per_sm: int | None = None, into: torch.Tensor | None = None,
            route: RouteInto | None = None, **norm) -> torch.Tensor:
    """The kernel's launch for the entry points (shapes already checked but the rows and
    SwiGLU's halves): its output [M, N], or [M, N / 2] with swiglu; programs_per_sm (whole-K
    tiles): runs of blocks a program, for about that many programs an SM. into: the outputs
    are added into it, and the sums of squares' parts [M, programs] are returned. route: the
    outputs are one row of a router's logits, routed by the launch's last program."""
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"{name} takes 1..{MAX_ROWS} rows, got {m}")
    if swiglu and (n % 2 or block_n < 2):
        raise ValueError(f"{name}(swiglu=True): {n} weight rows are not gate and up halves, "
                         f"or block_n {block_n} holds no pair")
    outputs, per_program = (n // 2, block_n // 2) if swiglu else (n, block_n)
    blocks = triton.cdiv(outputs, per_program)
    per_run = 1
    if programs_per_sm is not None:
        if not (prefetch and block_k >= k):
            raise ValueError(f"{name}: programs_per_sm takes a tile over the whole of K")
        per_run = triton.cdiv(blocks, programs_per_sm * sm_count(x.device, 2))
    programs = triton.cdiv(blocks, per_run)
    if into is None:
        out = torch.empty(m, outputs, dtype=x.dtype, device=x.device)
    else:  # the kernel writes the parts, not out
        out = torch.empty(m, programs, dtype=torch.float32, device=x.device)
        norm.update(ADD_INTO=True, add_ptr=into, parts_ptr=out)
    if route is not None:
        top_k = route.weights.shape[1]
        if m != 1 or swiglu or route.weights.shape != (1, top_k) or route.ids.shape != (1, top_k):
            raise ValueError(f"{name}: routing inside takes one row of logits and [1, top_k] "
                             "weights and ids")
        norm.update(ROUTE=True, arrivals_ptr=route.arrivals, route_w_ptr=route.weights,
                    route_ids_ptr=route.ids, top_k=top_k, RENORMALIZE=route.renormalize,
                    BLOCK_E=triton.next_power_of_2(outputs),
                    BLOCK_TOPK=triton.next_power_of_2(top_k))
    _small_m_linear_kernel[(programs,)](
        x, weight, out, m, n, k, x.stride(0), weight.stride(0), outputs,
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=outputs % per_program == 0 and k % block_k == 0, PREFETCH=prefetch,
        WHOLE_K=prefetch and block_k >= k, SWIGLU=swiglu, **pdl_options(x.device), **norm,
        RUNS=programs_per_sm is not None, blocks_per_program=per_run, num_warps=num_warps,
        num_stages=num_stages)
    return out
