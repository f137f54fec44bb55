"""One-shot all-reduce of row-parallel partial sums, fused with the residual add and RMSNorm
that follow it, over buffers every rank can read (CUDA peer mapping; no NVLink multicast).

A tensor-parallel decode step at batch 1 all-reduces a few KiB per layer twice, and each NCCL
all-reduce then costs ~10 µs inside a CUDA graph, most of it latency. Here one program owns one
row. It copies its partial row into this rank's buffer, meets the same row's program on every
peer at a barrier, sums all ranks' copies in rank order (every rank gets the same bits and so
samples the same token) and then does what `fused_add_rms_norm` does: one launch instead of an
all-reduce and a norm.

Barrier: `signals` is this rank's pad of int32 [rows, world]; entry [row, p] is the last phase
rank p announced for that row. Call c of a row (counted per row in `calls`, on the device, so
CUDA-graph replays count too) has two phases: 2c - 1, "my copy is in my buffer", and 2c, "I have
read every peer's buffer". A program announces a phase by writing it into every peer's pad
(release, system scope) and waits until each peer's entry in its own pad has reached it (acquire;
a peer may already be one phase further). Before copying into its buffer a program waits for
phase 2(c - 1) from every peer, so the previous call's readers are done; the wait is usually
over already, which leaves one barrier on the critical path.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.norm import add_rms_norm_row
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _announce(signal_ptr, peer_offsets_ptr, row, rank, phase, WORLD: tl.constexpr):
    tl.debug_barrier()  # every thread's earlier writes and reads come before the announcement
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_pad = signal_ptr + tl.load(peer_offsets_ptr + p)
            tl.atomic_xchg(peer_pad + row * WORLD + rank, phase, sem="release", scope="sys")


@triton.jit
def _wait_for(signal_ptr, row, rank, phase, WORLD: tl.constexpr):
    for p in tl.static_range(WORLD):
        if p != rank:
            entry = signal_ptr + row * WORLD + p
            # wrapping difference: equality and "one phase ahead" both pass, across overflow
            while tl.atomic_add(entry, 0, sem="acquire", scope="sys") - phase < 0:
                pass
    # no thread reads a peer's buffer before the wait is over: the acquire above and this
    # CTA barrier order every thread's later loads after the peer's release
    tl.debug_barrier()


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,  # [rows, n_cols] this rank's partial sums
    residual_ptr,  # [rows, n_cols] in: residual; out: residual + all-reduced x
    w_ptr,  # [n_cols]
    out_ptr,  # [rows, n_cols] rms_norm of the new residual
    buffer_ptr,  # this rank's peer-readable buffer, >= rows * n_cols elements
    buffer_offsets_ptr,  # [world] int64: each rank's buffer minus buffer_ptr, in elements
    signal_ptr,  # this rank's pad, int32 [>= rows, world], zeroed before the first call
    signal_offsets_ptr,  # [world] int64: each rank's pad minus signal_ptr, in elements
    calls_ptr,  # [>= rows] int32: calls so far per row, this rank's own
    rank,
    n_cols,
    eps,
    stride_x,
    stride_r,
    stride_o,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    call = tl.load(calls_ptr + row) + 1
    tl.store(calls_ptr + row, call)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)

    _wait_for(signal_ptr, row, rank, 2 * call - 2, WORLD)  # peers done with my last copy
    tl.store(buffer_ptr + row * n_cols + cols, x, mask=mask)
    _announce(signal_ptr, signal_offsets_ptr, row, rank, 2 * call - 1, WORLD)
    _wait_for(signal_ptr, row, rank, 2 * call - 1, WORLD)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            total += x.to(tl.float32)
        else:
            # peer buffers are whole-page mappings: 16-element alignment lets loads vectorise
            peer = buffer_ptr + tl.multiple_of(tl.load(buffer_offsets_ptr + p), 16)
            total += tl.load(peer + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    _announce(signal_ptr, signal_offsets_ptr, row, rank, 2 * call, WORLD)

    # as all_reduce (rounded to the dtype) followed by fused_add_rms_norm
    add_rms_norm_row(total.to(x.dtype), residual_ptr + row * stride_r, w_ptr,
                     out_ptr + row * stride_o, cols, mask, n_cols, eps)


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rank: int,
    buffer: torch.Tensor,
    buffer_offsets: torch.Tensor,
    signals: torch.Tensor,
    signal_offsets: torch.Tensor,
    calls: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + Σ_ranks x), residual + Σ_ranks x); residual is updated in place.

    Every rank of the group must make the same calls with the same row count: each row's
    program meets its peers. buffer/signals are this rank's peer-readable allocations and
    *_offsets [world] int64 locate every rank's (itself included) relative to them, in elements.
    """
    assert x.shape == residual.shape and x.dtype == residual.dtype == buffer.dtype
    x2, r2 = x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1])
    rows, n_cols = x2.shape
    world = buffer_offsets.numel()
    assert rows * n_cols <= buffer.numel() and rows <= calls.numel()
    assert signals.dtype == torch.int32 and signals.numel() >= rows * world
    assert x2.stride(1) == 1 and r2.stride(1) == 1
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    if rows:
        _all_reduce_add_rms_norm_kernel[(rows,)](
            x2, r2, weight, out.view(-1, n_cols), buffer, buffer_offsets, signals,
            signal_offsets, calls, rank, n_cols, eps, x2.stride(0), r2.stride(0), n_cols,
            WORLD=world, BLOCK=block, **pdl_options(x.device),
            num_warps=max(1, min(16, block // 512)))
    return out, residual
