"""Ask the L2 cache for a weight before the kernel that streams it starts.

At batch 1 a decode step alternates GEMVs, which stream their weights from HBM, with short
latency-bound kernels (norms, attention, RoPE, SwiGLU, the all-reduce) during which HBM idles.
Spare programs of such a kernel can issue L2 prefetches (`prefetch.global.L2::evict_last`, one per
128-byte line) for the start of the next GEMV's weight, which that GEMV then reads from the L2.
Whether it pays, and how many bytes a short kernel can bring in, is what
tools/bench_l2_prefetch.py measures; no engine kernel prefetches yet.
"""

import os

import triton
import triton.language as tl

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
