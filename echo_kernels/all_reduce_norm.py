"""One-shot all-reduce of row-parallel partial sums, fused with the residual add and RMSNorm
that follow it, over buffers every rank can read (CUDA peer mapping; no NVLink multicast).

A tensor-parallel decode step at batch 1 all-reduces a few KiB per layer twice, and each NCCL
all-reduce then costs ~10 µs inside a CUDA graph, most of it latency. Here each program owns
rows pid, pid + P, ... (P programs, at most one per SM, so all are resident together). It
copies its rows' partial sums into this rank's buffer, meets the same program on every peer at
a barrier, sums all ranks' copies in rank order (every rank gets the same bits and so samples
the same token) and then does what `fused_add_rms_norm` does: one launch instead of an
all-reduce and a norm. At two ranks each rank reads the other's rows once, the same bytes as
NCCL's reduce-scatter + all-gather, so larger batches gain too.

Barrier: `signals` is this rank's pad of int32 [programs, world]; entry [pid, p] is the last
call rank p announced for program pid. Calls are counted per program in `calls`, on the device,
so CUDA-graph replays count too; every rank makes the same calls with the same row count, and
row r always belongs to program r mod P_max (P_max = calls.numel()), so a program meets the
same rows on every rank in every call. In call c a program copies its rows into half c mod 2 of
its buffer, announces c by writing it into every peer's pad (release, system scope), waits until
each peer's entry in its own pad has reached c (acquire) and reads every rank's half c mod 2.
One barrier per call, because the halves alternate: a peer announces c + 1 only after it has
finished call c, so the copy of call c + 2 into the same half cannot overtake a peer still
reading call c, and no peer gets more than one call ahead (it would need this rank's c + 1).
"""

import torch
import triton
import triton.language as tl

from echo_kernels.norm import add_rms_norm_row
from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _announce(signal_ptr, peer_offsets_ptr, pid, rank, phase, WORLD: tl.constexpr):
    tl.debug_barrier()  # every thread's earlier writes and reads come before the announcement
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_pad = signal_ptr + tl.load(peer_offsets_ptr + p)
            tl.atomic_xchg(peer_pad + pid * WORLD + rank, phase, sem="release", scope="sys")


@triton.jit
def _wait_for(signal_ptr, pid, rank, phase, WORLD: tl.constexpr):
    for p in tl.static_range(WORLD):
        if p != rank:
            entry = signal_ptr + pid * WORLD + p
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
    buffer_ptr,  # this rank's peer-readable buffer: two halves of >= rows * n_cols elements
    half,  # elements per half
    buffer_offsets_ptr,  # [world] int64: each rank's buffer minus buffer_ptr, in elements
    signal_ptr,  # this rank's pad, int32 [>= programs, world], zeroed before the first call
    signal_offsets_ptr,  # [world] int64: each rank's pad minus signal_ptr, in elements
    calls_ptr,  # [>= programs] int32: calls so far per program, this rank's own
    rank,
    rows,
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
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    call = tl.load(calls_ptr + pid) + 1
    tl.store(calls_ptr + pid, call)

    slot = buffer_ptr + (call & 1) * half  # the parity survives the int32 wrap
    for row in tl.range(pid, rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        tl.store(slot + row * n_cols + cols, x, mask=mask)
    _announce(signal_ptr, signal_offsets_ptr, pid, rank, call, WORLD)
    _wait_for(signal_ptr, pid, rank, call, WORLD)
    for row in tl.range(pid, rows, programs):
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # rank order, this rank's own buffer included
            # peer buffers are whole-page mappings and halves multiples of 16 elements:
            # the alignment lets loads vectorise
            src = slot + tl.multiple_of(tl.load(buffer_offsets_ptr + p), 16)
            total += tl.load(src + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        # as all_reduce (rounded to the dtype) followed by fused_add_rms_norm
        add_rms_norm_row(total.to(x_ptr.dtype.element_ty), residual_ptr + row * stride_r, w_ptr,
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

    Every rank of the group must make the same calls with the same row count: each program
    meets its peers. buffer/signals are this rank's peer-readable allocations and *_offsets
    [world] int64 locate every rank's (itself included) relative to them, in elements; the
    buffer's two halves alternate between calls. At most calls.numel() programs run: no more
    than can be resident at once.
    """
    assert x.shape == residual.shape and x.dtype == residual.dtype == buffer.dtype
    x2, r2 = x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1])
    rows, n_cols = x2.shape
    world = buffer_offsets.numel()
    programs = min(rows, calls.numel())
    half = buffer.numel() // 2 // 16 * 16  # a multiple of 16 elements: see the kernel
    assert rows * n_cols <= half, "more rows than half the buffer holds"
    assert signals.dtype == torch.int32 and signals.numel() >= calls.numel() * world
    assert x2.stride(1) == 1 and r2.stride(1) == 1
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    if rows:
        _all_reduce_add_rms_norm_kernel[(programs,)](
            x2, r2, weight, out.view(-1, n_cols), buffer, half, buffer_offsets, signals,
            signal_offsets, calls, rank, rows, n_cols, eps, x2.stride(0), r2.stride(0), n_cols,
            WORLD=world, BLOCK=block, **pdl_options(x.device),
            num_warps=max(1, min(16, block // 512)))
    return out, residual
