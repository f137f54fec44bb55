"""How much of a GEMV can hide behind the short kernel before it under PDL?

    python tools/bench_gemv_overlap.py [--tp 1|2] [--spin-us 2,5] [--json F]

At batch 1 every GEMV of a decode step follows a short latency-bound kernel (a norm, attention,
SwiGLU, the all-reduce) during which HBM idles. Launched with PDL, the GEMV's programs become
resident while that kernel runs, and whatever weight they load before their PDL wait streams
in that idle time (small_m_linear's `preload_k` columns, or one tile with `prefetch`). Per
Qwen3-8B weight shape (a TP rank's), in one CUDA graph over copies of the weight larger than the
L2 (the weights a step really streams), this times pairs of a stand-in for the short kernel
(one program spinning for T µs, PDL-aware like echo's kernels) and the GEMV. Prints µs per pair.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo.worker.linear_tuning import cuda_graph_timer, gemv  # noqa: E402
from echo_kernels.pdl import pdl_options, wait_for_inputs  # noqa: E402

MIB = 1 << 20
SHAPES = {  # Qwen3-8B's linear layers, (N, K) of one rank
    1: {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
        "down": (4096, 12288)},
    2: {"qkv": (3072, 4096), "o_proj": (4096, 2048), "gate_up": (12288, 4096),
        "down": (4096, 6144)},
}
# (block_n, block_k, prefetch, preload_k)
TILES = ((8, 512, False, 0), (8, 512, True, 0), (8, 512, False, 1024), (8, 512, False, 2048),
         (8, 512, True, 2048), (4, 512, False, 2048), (8, 512, False, 4096),
         (16, 512, False, 1024))


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _spin_kernel(spin_ns, USE_PDL: tl.constexpr):
    wait_for_inputs(USE_PDL)
    start = _now()
    while _now() - start < spin_ns:
        pass


def spin(us: float, device: torch.device) -> None:
    _spin_kernel[(1,)](int(us * 1e3), **pdl_options(device), num_warps=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1)
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
        gemms = {"cuBLAS": F.linear}
        gemms.update({f"gemv {'x'.join(map(str, t[:2]))}{' prefetch' if t[2] else ''}"
                      f" preload {t[3]}": gemv(*t) for t in TILES})
        row = {}
        for g, fn in gemms.items():
            row[f"{g} alone"] = cuda_graph_timer(fn, x, weights)
        for us in args.spin_us:
            row[f"spin {us:g} us alone"] = cuda_graph_timer(lambda x, w, s=us: spin(s, device),
                                                           x, weights)
            for g, fn in gemms.items():
                def pair(x, w, fn=fn, s=us):
                    spin(s, device)
                    return fn(x, w)

                row[f"{g} after {us:g} us"] = cuda_graph_timer(pair, x, weights)
        results[name] = row
        print(f"{name} {n}x{k} ({nbytes / MIB:.0f} MiB, {copies} copies), µs per call:")
        for label, t in row.items():
            print(f"  {label:<52} {t:8.2f}")
        weights = None
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tp": args.tp, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
