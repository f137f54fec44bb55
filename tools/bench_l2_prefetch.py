"""Does prefetching a GEMV's weight into the L2, during the short kernel before it, pay?

    python tools/bench_l2_prefetch.py [--tp 1|2] [--spin-us 2,5,10] [--json F]

At batch 1 every GEMV of a decode step follows a short latency-bound kernel (a norm, attention,
SwiGLU, the all-reduce) during which HBM idles. Per Qwen3-8B weight shape (a TP rank's), in one
CUDA graph over copies of the weight larger than the L2 (the weights a step really streams),
this times pairs of: a stand-in for the short kernel (one program spins for T µs while spare
programs prefetch the first X MiB of the next weight, echo_kernels.l2_prefetch) and the GEMV
that reads that weight (echo's small_m_linear with PDL, as in the engine, or cuBLAS). X = 0 is
a step as it runs today. Prints µs per pair.
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

from echo.worker.linear_tuning import cuda_graph_timer  # noqa: E402
from echo_kernels.l2_prefetch import prefetch_l2  # noqa: E402
from echo_kernels.linear import small_m_linear  # noqa: E402
from echo_kernels.pdl import pdl_options, wait_for_inputs  # noqa: E402

MIB = 1 << 20
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
def _short_kernel(w_ptr, nbytes, spin_ns, USE_PDL: tl.constexpr, LINES: tl.constexpr):
    wait_for_inputs(USE_PDL)
    pid = tl.program_id(0)
    if pid == 0:  # the short kernel's own work: latency, no bandwidth
        start = _now()
        while _now() - start < spin_ns:
            pass
    else:
        prefetch_l2(w_ptr, nbytes, pid - 1, tl.num_programs(0) - 1, LINES)


def short_kernel(w: torch.Tensor, prefetch_bytes: int, spin_us: float) -> None:
    programs = 1 + (PREFETCH_PROGRAMS if prefetch_bytes else 0)
    _short_kernel[(programs,)](w, min(prefetch_bytes, w.numel() * w.element_size()),
                               int(spin_us * 1e3), **pdl_options(w.device), LINES=512,
                               num_warps=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2)
    parser.add_argument("--spin-us", default="2,5,10",
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
        gemms = {"small_m_linear": small_m_linear, "cuBLAS": F.linear}
        row = {f"{g} alone": cuda_graph_timer(fn, x, weights) for g, fn in gemms.items()}
        for spin in args.spin_us:
            row[f"short {spin:g} us alone"] = cuda_graph_timer(
                lambda x, w, s=spin: short_kernel(w, 0, s), x, weights)
            for g, fn in gemms.items():
                for mib in (0, 8, 16, 32, nbytes / MIB):
                    if mib > nbytes / MIB:
                        continue

                    def pair(x, w, fn=fn, b=int(mib * MIB), s=spin):
                        short_kernel(w, b, s)
                        return fn(x, w)

                    row[f"{g} after {spin:g} us, {mib:.0f} MiB prefetched"] = \
                        cuda_graph_timer(pair, x, weights)
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
