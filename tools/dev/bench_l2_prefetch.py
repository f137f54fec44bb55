"""Does prefetching a GEMV's weight into the L2, during the short kernel before it, pay?

    python tools/dev/bench_l2_prefetch.py [--tp 1|2] [--spin-us 2,5] [--json F]

At batch 1 every GEMV of a decode step follows a short latency-bound kernel (a norm, attention,
SwiGLU, the all-reduce) during which HBM idles. Per Qwen3-8B weight shape (a TP rank's), in one
CUDA graph over copies of the weight larger than the L2 (the weights a step really streams),
this times pairs of: a stand-in for the short kernel (one program spins for T µs while spare
programs prefetch X MiB of the next weight, in each of the modes below) and
the GEMV that reads that weight (echo's small_m_linear with PDL, as in the engine, or cuBLAS).
X = 0 is a step as it runs today. Prints µs per pair.

What the GEMV reads first decides what pays. `small_m_linear` gives every program whole rows and
runs all programs at once, so it consumes the weight as a front moving along K over every row.
The first attempt (baae8fc, 2026-11-30, removed; docs/benchmarks.md) prefetched the weight's first
bytes: whole rows of the first programs only. Those programs then finished early while the rest
still streamed everything from HBM, and the extra instructions (one prefetch per 128-byte line)
lengthened the short kernel. The slab modes take the first bytes of every row instead, by lines
or by one bulk prefetch per row (`cp.async.bulk.prefetch.L2`, sm_90).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from echo.worker.linear_tuning import cuda_graph_timer  # noqa: E402
from echo_kernels.linear import small_m_linear  # noqa: E402
from echo_kernels.pdl import pdl_options, wait_for_inputs  # noqa: E402

MIB = 1 << 20

LINE_BYTES = tl.constexpr(128)

ROWS_FIRST = 0  # the first nbytes of the weight, row after row (the first attempt)
SLAB_LINES = 1  # the first nbytes / rows of every row, a prefetch per 128-byte line
SLAB_BULK = 2  # the same, one bulk prefetch per row


@triton.jit
def _prefetch_lines(addr, ok):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
        "mov.u32 $0, 0; }",
        "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_bulk(addr, nbytes, ok):
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, nbytes, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_weight(w_ptr, rows, row_bytes, nbytes, part, parts, MODE: tl.constexpr,
                    ROWS: tl.constexpr, LINES: tl.constexpr):
    """Program `part` of `parts` prefetches its share of nbytes of the weight [rows, row_bytes]
    (MODE: ROWS_FIRST, SLAB_LINES or SLAB_BULK; ROWS rows and LINES lines per step).

    Fire and forget: the instructions return at once and the L2 fetches behind them."""
    base = w_ptr.to(tl.pointer_type(tl.int8))
    if MODE == 0:  # ROWS_FIRST
        lines = tl.cdiv(nbytes, LINE_BYTES)
        for first in range(part * LINES, lines, parts * LINES):
            line = first + tl.arange(0, LINES).to(tl.int64)
            _prefetch_lines(base + line * LINE_BYTES, line < lines)
    else:
        # bulk sizes are multiples of 16 bytes; lines cover the slab rounded up
        slab = tl.cdiv(tl.cdiv(nbytes, rows), 16) * 16
        for first in range(part * ROWS, rows, parts * ROWS):
            row = first + tl.arange(0, ROWS)
            row_ok = row < rows
            row_start = base + row.to(tl.int64) * row_bytes
            if MODE == 1:  # SLAB_LINES
                line = tl.arange(0, LINES)
                for l0 in range(0, tl.cdiv(slab, LINE_BYTES), LINES):
                    offs = (l0 + line) * LINE_BYTES
                    _prefetch_lines(row_start[:, None] + offs[None, :],
                                    row_ok[:, None] & (offs[None, :] < slab))
            else:  # SLAB_BULK
                _prefetch_bulk(row_start, tl.full([ROWS], 0, tl.int32) + slab, row_ok)


PREFETCH_PROGRAMS = 32
SHAPES = {  # Qwen3-8B's linear layers, (N, K) of one rank
    1: {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
        "down": (4096, 12288)},
    2: {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (12288, 4096),
        "down": (4096, 6144)},
}


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _short_kernel(w_ptr, rows, row_bytes, nbytes, spin_ns, USE_PDL: tl.constexpr,
                  MODE: tl.constexpr, LINES: tl.constexpr):
    wait_for_inputs(USE_PDL)
    pid = tl.program_id(0)
    if pid == 0:  # the short kernel's own work: latency, no bandwidth
        start = _now()
        while _now() - start < spin_ns:
            pass
    else:
        prefetch_weight(w_ptr, rows, row_bytes, nbytes, pid - 1, tl.num_programs(0) - 1, MODE,
                        ROWS=128, LINES=LINES)


def short_kernel(w: torch.Tensor, prefetch_bytes: int, spin_us: float, mode: int) -> None:
    programs = 1 + (PREFETCH_PROGRAMS if prefetch_bytes else 0)
    nbytes = min(prefetch_bytes, w.numel() * w.element_size())
    _short_kernel[(programs,)](w, w.shape[0], w.stride(0) * w.element_size(), nbytes,
                               int(spin_us * 1e3), **pdl_options(w.device), MODE=mode,
                               LINES=512 if mode == ROWS_FIRST else 8, num_warps=4)


MODES = {"first rows": ROWS_FIRST, "slab, lines": SLAB_LINES, "slab, bulk": SLAB_BULK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--spin-us", default="2,5",
                        type=lambda s: [float(v) for v in s.split(",")])
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = {}
    for name, (n, k) in SHAPES[args.tp].items():
        nbytes = n * k * 2
        copies = max(4, -(-256 * MIB // nbytes))  # >= 256 MiB in rotation: past the L2
        weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) / 64
                   for _ in range(copies)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
        operands = [(w,) for w in weights]  # cuda_graph_timer calls fn(x, w) for each
        gemms = {"small_m_linear": small_m_linear, "cuBLAS": F.linear}
        row = {f"{g} alone": cuda_graph_timer(fn, x, operands, lead="none")
               for g, fn in gemms.items()}
        for spin in args.spin_us:
            row[f"short {spin:g} us alone"] = cuda_graph_timer(
                lambda x, w, s=spin: short_kernel(w, 0, s, ROWS_FIRST), x, operands, lead="none")
            for g, fn in gemms.items():
                for mode_name, mode in MODES.items():
                    for mib in (0, 4, 8, 16):
                        if mib == 0 and mode != ROWS_FIRST:
                            continue

                        def pair(x, w, fn=fn, b=int(mib * MIB), s=spin, m=mode):
                            short_kernel(w, b, s, m)
                            return fn(x, w)

                        label = f"{g} after {spin:g} us, {mib} MiB" + \
                            (f" ({mode_name})" if mib else "")
                        row[label] = cuda_graph_timer(pair, x, operands, lead="none")
        results[name] = row
        print(f"{name} {n}x{k} ({nbytes / MIB:.0f} MiB, {copies} copies), µs per call:")
        for label, us in row.items():
            print(f"  {label:<52} {us:8.2f}")
        weights = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp": args.tp, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
