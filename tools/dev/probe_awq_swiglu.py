"""An AWQ gate/up layer at one row: SwiGLU in its own launch after the GEMV, against SwiGLU
where the GEMV's splits are added (awq_gemv(swiglu=True)).

    python tools/dev/probe_awq_swiglu.py

Each call runs behind an RMSNorm, as in a decode step, in CUDA graphs over weight copies that
exceed the L2 (bench_kernels' AWQ rows); three alternations per shape.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import AWQ_GROUP, awq_copies, bench_graph  # noqa: E402

from echo_kernels import silu_and_mul  # noqa: E402
from echo_kernels.awq import awq_gemv  # noqa: E402
from echo_kernels.norm import rms_norm  # noqa: E402

SHAPES = {"Llama-3.1-8B": (28672, 4096), "Qwen3-8B": (24576, 4096)}  # gate_up's (N, K)


def calls(k: int, copies: list) -> tuple[list, list]:
    """(SwiGLU after the GEMV, SwiGLU in its split sum), one call per weight copy, each
    behind an RMSNorm of a row of K."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ones = torch.ones(k, device="cuda", dtype=torch.bfloat16)

    def normed():
        return rms_norm(x, ones, 1e-6)

    apart = [lambda c=c: silu_and_mul(awq_gemv(normed(), *c, AWQ_GROUP)) for c in copies]
    inside = [lambda c=c: awq_gemv(normed(), *c, AWQ_GROUP, swiglu=True) for c in copies]
    return apart, inside


def main() -> None:
    for name, (n, k) in SHAPES.items():
        copies, _ = awq_copies(n, k)
        apart, inside = calls(k, copies)
        for rep in range(3):
            a, b = bench_graph(apart), bench_graph(inside)
            print(f"{name} gate_up {n}x{k} run {rep}: norm + GEMV + SwiGLU {a * 1e3:.2f} us, "
                  f"norm + GEMV with SwiGLU in its split sum {b * 1e3:.2f} us")


if __name__ == "__main__":
    main()
