"""Ask the L2 cache for a weight before the kernel that streams it starts.

At batch 1 a decode step alternates GEMVs, which stream their weights from HBM, with short
latency-bound kernels (norms, attention, RoPE, SwiGLU, the all-reduce) during which HBM idles.
Spare programs of such a kernel can issue L2 prefetches (`prefetch.global.L2::evict_last`, one per
128-byte line) for the start of the next GEMV's weight, which that GEMV then reads from the L2.
Whether it pays, and how many bytes a short kernel can bring in, is what
tools/bench_l2_prefetch.py measures. In the engine it is opt-in (ECHO_L2_PREFETCH_MIB) until
measured: the norms, the RoPE/KV-store launch and SwiGLU of decode steps of at most MAX_ROWS
rows then get PREFETCH_PROGRAMS spare programs that prefetch the start of the next weight.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PREFETCH_PROGRAMS = 32
MAX_ROWS = 4  # batches this small make the next linear layer a pure weight stream
LINES_PER_STEP = tl.constexpr(512)
LINE_BYTES = tl.constexpr(128)
# the interpreter runs no inline asm; a prefetch changes no value, so there it is skipped
_PREFETCH = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def prefetch_l2(ptr, nbytes, part, parts, LINES: tl.constexpr):
    """Program `part` of `parts` prefetches its share of the nbytes from ptr, LINES lines a step.

    Fire and forget: the instructions return at once and the L2 fetches behind them."""
    if _PREFETCH:
        base = ptr.to(tl.pointer_type(tl.int8))
        lines = tl.cdiv(nbytes, LINE_BYTES)
        per_part = tl.cdiv(lines, parts)
        lo = part * per_part
        hi = tl.minimum(lo + per_part, lines).to(tl.int64)
        for first in range(lo, hi, LINES):
            line = first + tl.arange(0, LINES).to(tl.int64)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.lt.s64 p, $2, $3; "
                "@p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,l,l", [base + line * LINE_BYTES, line, hi + line * 0], dtype=tl.int32,
                is_pure=False, pack=1)


@triton.jit
def prefetch_if_spare(pf_ptr, pf_bytes, first_spare):
    """In a kernel launched with spare programs past `first_spare` on grid axis 0 (times the
    whole of axis 1): True for a spare program, after it has prefetched its share."""
    spare = tl.program_id(0) >= first_spare
    if spare:
        per_row = tl.num_programs(1)
        part = (tl.program_id(0) - first_spare) * per_row + tl.program_id(1)
        prefetch_l2(pf_ptr, pf_bytes, part, (tl.num_programs(0) - first_spare) * per_row,
                    LINES_PER_STEP)
    return spare


@dataclass(frozen=True)
class L2Prefetch:
    """What a short kernel's spare programs ask the L2 for: the first nbytes of a weight."""

    weight: torch.Tensor
    nbytes: int

    def for_rows(self, rows: int) -> "L2Prefetch | None":
        return self if rows <= MAX_ROWS else None


def launch_args(prefetch: L2Prefetch | None, placeholder: torch.Tensor) -> tuple:
    """(pointer, bytes, spare programs) for a launch; without prefetch, a placeholder pointer
    that is never read and no spare programs."""
    if prefetch is None:
        return placeholder, 0, 0
    return prefetch.weight, prefetch.nbytes, PREFETCH_PROGRAMS
