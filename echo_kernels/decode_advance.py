"""The device-side step between two decode steps of one launch (worker/multi_step.py), in one
kernel: each sampled token becomes its row's next input, the position, context length and
sample index grow by one, and the next KV slot is read off the block table.

Why a kernel: in PyTorch the same update is ~16 element-wise launches of a few rows each, every
one a launch latency in the sampling graph (and none of them PDL-aware); a kernel profile put
sampling and this update at ~19-24 us of a stories110M step of ~320 (docs/benchmarks.md,
Decode latency at batch 1).
reference.advance_decode_ref is its PyTorch twin and what the CPU runs.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs

# rows a program: one program at the batch sizes where the launch matters
_BLOCK = 128


# NOTE: rows, the block table's width and its row stride not specialised: every batch size
# runs the one compiled variant, also where (without graphs) the table is as wide as the batch's
# longest context, so no width compiles a variant inside a serving step
@triton.jit(do_not_specialize=["rows", "stride_bt", "width"])
def _advance_decode_kernel(
    input_ids_ptr,  # [rows] int64, in place
    positions_ptr,  # [rows] int64, in place
    slots_ptr,  # [rows] int64, in place; -1: a padding row, left as it is
    seq_lens_ptr,  # [rows] int32, in place
    sample_steps_ptr,  # [rows] int64, in place
    tokens_ptr,  # [rows] int64, this step's samples
    block_table_ptr,  # [>= rows, width] int32
    rows,
    stride_bt,
    width,
    block_size,
    max_position,  # HAS_MAX: rows at it store nothing from then on
    HAS_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < rows
    real = tl.load(slots_ptr + r, mask=ok, other=-1) >= 0
    step = real.to(tl.int64)
    token = tl.load(tokens_ptr + r, mask=ok & real)
    tl.store(input_ids_ptr + r, token, mask=ok & real)
    position = tl.load(positions_ptr + r, mask=ok, other=0) + step
    tl.store(seq_lens_ptr + r, tl.load(seq_lens_ptr + r, mask=ok) + step.to(tl.int32), mask=ok)
    tl.store(sample_steps_ptr + r, tl.load(sample_steps_ptr + r, mask=ok) + step, mask=ok)
    # past a launch's last step the position may pass the blocks allocated: that slot is never
    # used, but the read must stay inside the table
    index = tl.minimum(position // block_size, width - 1)
    block = tl.load(block_table_ptr + r.to(tl.int64) * stride_bt + index, mask=ok, other=0)
    if HAS_MAX:
        real = real & (position < max_position)
        position = tl.minimum(position, max_position - 1)
    tl.store(positions_ptr + r, position, mask=ok)
    tl.store(slots_ptr + r, tl.where(real, block.to(tl.int64) * block_size
                                     + position % block_size, -1), mask=ok)


def advance_decode(input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   seq_lens: torch.Tensor, sample_steps: torch.Tensor, tokens: torch.Tensor,
                   block_table: torch.Tensor, block_size: int,
                   max_position: int | None = None) -> None:
    """In place over the first tokens.shape[0] rows of each (as advance_decode_ref)."""
    rows = tokens.shape[0]
    assert input_ids.dtype == positions.dtype == slots.dtype == sample_steps.dtype == \
        tokens.dtype == torch.int64 and seq_lens.dtype == block_table.dtype == torch.int32
    assert all(t.is_contiguous() for t in (input_ids, positions, slots, seq_lens, sample_steps,
                                           tokens)) and block_table.stride(1) == 1
    assert block_table.shape[0] >= rows and min(
        t.numel() for t in (input_ids, positions, slots, seq_lens, sample_steps)) >= rows
    if not rows:
        return
    _advance_decode_kernel[(triton.cdiv(rows, _BLOCK),)](
        input_ids, positions, slots, seq_lens, sample_steps, tokens, block_table, rows,
        block_table.stride(0), block_table.shape[1], block_size,
        max_position if max_position is not None else 0, HAS_MAX=max_position is not None,
        BLOCK=_BLOCK, **pdl_options(tokens.device), num_warps=4)


def warm_up_advance_decode(device: torch.device, block_size: int,
                           max_position: int | None = None) -> None:
    """Compile advance_decode's variant for these settings on a padding row (which it leaves
    as it is), so that no serving step compiles it."""
    ids = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(4)]
    ids[2].fill_(-1)  # the slot: padding
    advance_decode(*ids[:3], torch.zeros(1, dtype=torch.int32, device=device), ids[3],
                   torch.zeros(1, dtype=torch.int64, device=device),
                   torch.zeros(1, 1, dtype=torch.int32, device=device), block_size, max_position)
