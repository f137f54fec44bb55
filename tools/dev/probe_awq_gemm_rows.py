"""AWQ rows through awq_gemm's tensor-core tiles, and through the dense weight.

    python tools/dev/probe_awq_gemm_rows.py [--rows 8,16,32]

Llama-3.1-8B's four layer shapes (bench_kernels' AWQ_SHAPES), fp16 x, each call in CUDA graphs
over weight copies beyond the L2 (bench_kernels' bench_graph), so the figures compare with
bench_kernels' decode rows. The default tile first, then the tiles named for that row count
(block_m, block_n, block_k, num_warps) and awq_dequantize + cuBLAS ("dense", awq_linear's
choice past LINEAR_GEMM_ROWS). From 64 rows also the tensor-core layout's kernels
(echo_kernels/awq_mma.py) over repacked copies: awq_gemm_repacked's default and other tiles
("repacked BMxTILESxWARPS"), and its dense weight + cuBLAS ("repacked dense"). To compare two
versions of the kernel, copy this file into the other tree and run it there as well: it
imports the echo_kernels of the tree it sits in.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import AWQ_GROUP, AWQ_SHAPES, awq_copies, bench_graph, fits  # noqa: E402

from echo_kernels.awq import awq_dequantize, awq_gemm  # noqa: E402
from echo_kernels.awq_mma import awq_dequantize_repacked, awq_gemm_repacked, repack_awq  # noqa: E402

DECODE_TILES = [(16, 128, 128, 4), (16, 64, 128, 4), (32, 128, 64, 4)]
# at 64 rows and more: the larger tiles awq_gemm's table holds, one row tile at 128 and 256
PREFILL_TILES = [(64, 128, 64, 4), (128, 128, 64, 8), (128, 256, 128, 8), "dense"]
# awq_gemm_repacked's (block_m, 16-column tiles, num_warps), None its default
REPACKED_TILES = [None, (128, 8, 8), (64, 16, 8), (64, 8, 4), "dense"]


def call(x, tile):
    """fn(qweight, qzeros, scales) for one variant."""
    if tile == "dense":
        return lambda *c: x @ awq_dequantize(*c, AWQ_GROUP, x.dtype)
    tiles = {} if tile is None else dict(zip(("block_m", "block_n", "block_k", "num_warps"),
                                             tile))
    return lambda *c: awq_gemm(x, *c, AWQ_GROUP, **tiles)


def call_repacked(x, tile):
    """fn(repacked qweight, qzeros, scales) for one variant of the tensor-core layout."""
    if tile == "dense":
        return lambda rq, *c: x @ awq_dequantize_repacked(rq, *c, AWQ_GROUP, x.dtype).t()
    tiles = {} if tile is None else dict(zip(("block_m", "tiles", "num_warps"), tile))
    return lambda *c: awq_gemm_repacked(x, *c, AWQ_GROUP, **tiles)


def time_variants(name, m, k, copies, variants, make, prefix=""):
    """One line a variant: make(x, variant)(*copy) over the copies in CUDA graphs."""
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    for tile in variants:
        fn = make(x, tile)
        ms = fits(lambda: bench_graph([lambda c=c: fn(*c) for c in copies]))  # noqa: B023
        label = prefix + ("default" if tile is None else
                          tile if isinstance(tile, str) else "x".join(map(str, tile)))
        us = "does not fit" if ms is None else f"{ms * 1e3:7.1f} us"
        print(f"{ROOT.name} {name:8s} M={m:<4d} {label:20s} {us}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16,32", help="row counts, comma-separated")
    rows = [int(m) for m in parser.parse_args().rows.split(",")]
    for name, (n, k) in AWQ_SHAPES.items():
        copies, _ = awq_copies(n, k)
        for m in rows:
            time_variants(name, m, k, copies, [None] + (DECODE_TILES + ["dense"] if m < 64
                                                     else PREFILL_TILES), call)
        if any(m >= 64 for m in rows):
            repacked = [(repack_awq(q, AWQ_GROUP), z, s) for q, z, s in copies]
            copies = None
            for m in rows:
                if m >= 64:
                    time_variants(name, m, k, repacked, REPACKED_TILES, call_repacked, "repacked ")
            repacked = None
        copies = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
