"""The AWQ one-row GEMV of this tree at Llama-3.1-8B's four layer shapes, to compare weight
layouts across trees.

    python tools/dev/probe_awq_gemv_layouts.py [--rows 1,2,4]

fp16 x (one row unless --rows), each call in CUDA graphs over weight copies beyond the L2
(bench_kernels' AWQ_SHAPES, awq_copies and bench_graph, so the weights come in whatever layout
this tree's bench_kernels makes them). It prints awq_linear's time per shape and row count; in
a tree whose awq_gemv takes whole weight rows (the N-major experiments 131270e and 63e7a03,
which have `awq.gemv_block_n`) also, at one row, the best rows a program and warps of a sweep
and the largest error against the dense weight. To compare, copy this file into the other tree
(`git archive REV`) and run it there in the same call: it imports the echo_kernels of the tree
it sits in.
"""

import argparse
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import AWQ_GROUP, AWQ_SHAPES, awq_copies, bench_graph, fits  # noqa: E402

import echo_kernels.awq as awq  # noqa: E402

SWEEP = [(rows, warps) for rows in (2, 4, 8, 16, 32) for warps in (2, 4, 8)]


def sweep_rows(x: torch.Tensor, copies: list) -> list[tuple[float, int, int]]:
    """(µs, rows a program, warps) of the N-major GEMV's settings that fit, fastest first."""
    times = []
    for rows, warps in SWEEP:
        gemv = functools.partial(awq.awq_gemv, block_n=rows, num_warps=warps)
        ms = fits(lambda g=gemv: bench_graph([lambda c=c: g(x, *c, AWQ_GROUP) for c in copies]))
        if ms is not None:
            times.append((ms * 1e3, rows, warps))
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1", help="row counts, comma-separated (1-4)")
    row_counts = [int(m) for m in parser.parse_args().rows.split(",")]
    rows_layout = hasattr(awq, "gemv_block_n")
    for name, (n, k) in AWQ_SHAPES.items():
        copies, nbytes = awq_copies(n, k)
        for m in row_counts:
            xm = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ms = bench_graph([lambda c=c, x=xm: awq.awq_linear(x, *c, AWQ_GROUP)
                              for c in copies])
            print(f"awq_linear {name} {n}x{k}, {m} row(s): {ms * 1e3:.1f} us "
                  f"({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
        x = torch.randn(1, k, device="cuda", dtype=torch.float16)
        if rows_layout:  # the sweep and the check at one row
            best = ", ".join(f"{us:.1f} us ({rows} rows, {warps} warps)"
                             for us, rows, warps in sweep_rows(x, copies)[:3])
            dense = awq.awq_dequantize(*copies[0], AWQ_GROUP, torch.float32)
            err = (awq.awq_linear(x, *copies[0], AWQ_GROUP).float() - x.float() @ dense.T)
            print(f"  fastest: {best}; largest error {err.abs().max().item():.3g}", flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
