"""One-shot all-reduce of row-parallel partial sums, fused with the residual add and RMSNorm
that follow it, over buffers every rank can write (CUDA peer mapping; no NVLink multicast).

A tensor-parallel decode step at batch 1 all-reduces a few KiB per layer twice, and each NCCL
all-reduce is then latency bound inside a CUDA graph (docs/benchmarks.md, All-reduce). Here each
program owns rows pid, pid + P, ... (P programs, at most one per SM, so all are resident
together). It writes its rows' partial sums straight into every peer's inbox, waits until every
peer's rows have arrived in its own, sums all ranks' values in rank order (every rank gets the
same bits and so samples the same token) and then does what `fused_add_rms_norm` does: one
launch instead of an all-reduce and a norm. Each rank sends its rows once and reads only local
memory.

No flags (Lamport's scheme): an inbox element holding -0.0 has not arrived yet. Senders turn
-0.0 into +0.0 (a sum that was -0.0 comes out +0.0), a reader polls its rows until none is
-0.0, then writes -0.0 back. The inbox is integer storage of the same width (`inbox_dtype`),
so the test is on bits (-0.0 == +0.0 as floats): -0.0 is the integer type's minimum.

Inbox: [2 slots][world][region] elements; region >= rows * n_cols. Calls are counted per
program in `calls`, on the device, so CUDA-graph replays count too; every rank makes the same
calls with the same row count, and row r always belongs to program r mod P_max (P_max =
calls.numel()), so a program meets the same rows on every rank in every call. Call c uses slot
c mod 2. Two slots suffice: a peer writes slot c mod 2 again only in call c + 2, which needs
this rank's rows of call c + 1, sent after this rank has read and reset its slot for call c.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.norm import add_rms_norm_row
from echo_kernels.pdl import pdl_options, wait_for_inputs


def inbox_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer type an inbox for `dtype` rows holds: -0.0 reads as its minimum."""
    return {2: torch.int16, 4: torch.int32}[dtype.itemsize]


def not_arrived(dtype: torch.dtype) -> int:
    """The "not arrived" mark in an inbox for `dtype` rows: the bits of -0.0."""
    return torch.iinfo(inbox_dtype(dtype)).min


@triton.jit
def _arrived(inbox_row, cols, mask, NOT_ARRIVED: tl.constexpr):
    """The row once every element is in, and its slots reset to NOT_ARRIVED."""
    bits = tl.load(inbox_row + cols, mask=mask, other=0, volatile=True)
    while tl.sum((bits == NOT_ARRIVED).to(tl.int32), 0) > 0:
        bits = tl.load(inbox_row + cols, mask=mask, other=0, volatile=True)
    tl.store(inbox_row + cols, tl.full(bits.shape, NOT_ARRIVED, bits.dtype), mask=mask)
    return bits


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    x_ptr,  # [rows, n_cols] this rank's partial sums
    residual_ptr,  # [rows, n_cols] in: residual; out: residual + all-reduced x
    w_ptr,  # [n_cols]
    out_ptr,  # [rows, n_cols] rms_norm of the new residual
    inbox_ptr,  # this rank's inbox, inbox_dtype: [2][world][region], NOT_ARRIVED where empty
    region,  # elements per sender per slot, a multiple of 16
    inbox_offsets_ptr,  # [world] int64: each rank's inbox minus inbox_ptr, in elements
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
    NOT_ARRIVED: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    call = tl.load(calls_ptr + pid) + 1
    tl.store(calls_ptr + pid, call)
    slot = inbox_ptr + (call & 1) * (WORLD * region)  # the parity survives the int32 wrap
    dtype = x_ptr.dtype.element_ty

    for row in tl.range(pid, rows, programs):
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        # no -0.0 sent
        bits = tl.where(x == 0, 0.0, x).to(dtype).to(inbox_ptr.dtype.element_ty, bitcast=True)
        for p in tl.static_range(WORLD):
            if p != rank:
                # inboxes are whole-page mappings and regions multiples of 16 elements: the
                # alignment lets the stores vectorise
                peer = slot + tl.multiple_of(tl.load(inbox_offsets_ptr + p), 16)
                tl.store(peer + rank * region + row * n_cols + cols, bits, mask=mask)
    for row in tl.range(pid, rows, programs):
        # from +0.0: a -0.0 of this rank's own rows adds up as the +0.0 its peers got
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):  # rank order, this rank's own rows included
            if p == rank:
                x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
            else:
                bits = _arrived(slot + p * region + row * n_cols, cols, mask, NOT_ARRIVED)
                x = bits.to(dtype, bitcast=True)
            total += x.to(tl.float32)
        # as all_reduce (rounded to the dtype) followed by fused_add_rms_norm
        add_rms_norm_row(total.to(dtype), residual_ptr + row * stride_r, w_ptr,
                         out_ptr + row * stride_o, cols, mask, n_cols, eps)


def inbox_elements(world: int, max_rows: int, n_cols: int) -> int:
    """The size of an inbox for calls of up to max_rows rows."""
    return 2 * world * _region(max_rows * n_cols)


def _region(elements: int) -> int:
    return -(-elements // 16) * 16


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    rank: int,
    inbox: torch.Tensor,
    inbox_offsets: torch.Tensor,
    calls: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + Σ_ranks x), residual + Σ_ranks x); residual is updated in place.

    Every rank of the group must make the same calls with the same row count: each program
    meets its peers. inbox is this rank's peer-writable allocation (inbox_dtype(x.dtype),
    filled with not_arrived(x.dtype) before any rank's first call) and inbox_offsets [world]
    int64 locates every rank's (itself included) relative to it, in elements. At most
    calls.numel() programs run: no more than can be resident at once.
    """
    assert x.shape == residual.shape and x.dtype == residual.dtype
    assert inbox.dtype == inbox_dtype(x.dtype)
    x2, r2 = x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1])
    rows, n_cols = x2.shape
    world = inbox_offsets.numel()
    region = inbox.numel() // (2 * world) // 16 * 16  # a multiple of 16 elements: see the kernel
    assert rows * n_cols <= region, "more rows than the inbox holds"
    assert x2.stride(1) == 1 and r2.stride(1) == 1
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n_cols)
    if rows:
        _all_reduce_add_rms_norm_kernel[(min(rows, calls.numel()),)](
            x2, r2, weight, out.view(-1, n_cols), inbox, region, inbox_offsets, calls, rank,
            rows, n_cols, eps, x2.stride(0), r2.stride(0), n_cols, WORLD=world, BLOCK=block,
            NOT_ARRIVED=not_arrived(x.dtype), **pdl_options(x.device),
            num_warps=max(1, min(16, block // 512)))
    return out, residual
