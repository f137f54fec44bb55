"""AWQ decode rows through awq_gemm's tensor-core tile: a few tiles at M = 8, 16 and 32.

    python tools/dev/probe_awq_gemm_rows.py

Llama-3.1-8B's four layer shapes (bench_kernels' AWQ_SHAPES), fp16 x, each call in CUDA graphs
over weight copies beyond the L2 (bench_kernels' bench_graph), so the figures compare with
bench_kernels' decode rows. The default tile first, then the tiles named in TILES. To compare
two versions of the kernel, copy this file into the other tree and run it there as well: it
imports the echo_kernels of the tree it sits in.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import AWQ_GROUP, AWQ_SHAPES, bench_graph, fits, random_awq  # noqa: E402

from echo_kernels.awq import awq_gemm  # noqa: E402

TILES = [None, (16, 128, 128), (16, 64, 128), (32, 128, 64)]  # (block_m, block_n, block_k)


def main() -> None:
    for name, (n, k) in AWQ_SHAPES.items():
        nbytes = k * n // 2 + (k // AWQ_GROUP) * n * 5 // 2
        copies = [random_awq(n, k) for _ in range(max(2, -(-160 * 2**20 // nbytes)))]
        for m in (8, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            for tile in TILES:
                tiles = {} if tile is None else dict(zip(("block_m", "block_n", "block_k"), tile))
                ms = fits(lambda: bench_graph([  # noqa: B023
                    lambda c=c: awq_gemm(x, *c, AWQ_GROUP, **tiles) for c in copies]))  # noqa: B023
                label = "default" if tile is None else "x".join(map(str, tile))
                us = "does not fit" if ms is None else f"{ms * 1e3:7.1f} us"
                print(f"{ROOT.name} {name:8s} M={m:<3d} {label:12s} {us}", flush=True)
        copies = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
