"""Would an AWQ weight repacked N-major at load time make the one-row GEMV faster?

    python tools/dev/probe_awq_gemv_nmajor.py [--tiles 8x1024x4,16x1024x4,...]

#30's question. AutoAWQ's qweight is K-major ([K, N / 8]: a weight row of 512 columns is 256
bytes), so awq_gemv splits K over many programs to have enough loads in flight, and every
split writes float32 partial sums that a second launch adds: at Llama-3.1-8B's qkv that is
~2 MB written and read back beside 12.6 MB of weights, and a launch more a layer's GEMV.
Repacked N-major ([N, K / 8]: each int32 eight consecutive K of one column), a program owns a
few whole columns over the whole K, as the bf16 GEMV's programs do: contiguous 16-byte loads,
no partial sums, one launch.

The repacked int32 keeps AWQ's nibble positions (the r-th of its eight K at bit 4 (r // 2) +
16 (r % 2)), so awq.py's _unpack_offsets turns it into the floats 1 + q u with no more
instructions a weight than awq_gemv. The unit u now varies along K (2**-8 or 2**-4 by r), so
it goes into x instead of the scale: with x' = x / u (exact, a power of two) and z' = 1 + z u,
sum_k x_k (q_k - z) = sum_k x'_k (w_k - z'_k), a group at a time.

Llama-3.1-8B's four layer shapes (bench_kernels' AWQ_SHAPES), group 128, fp16 x, one row, in
CUDA graphs over weight copies beyond the L2: awq_gemv's default (with its split sum) against
the N-major kernel at each tile (block_n columns, warps, groups in flight); each output is
checked against the dequantized reference first. Bytes: packed weight, zeros and scales.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from echo_kernels.awq import _ONE_BITS, _inverse_units, _unpack_offsets, awq_gemv  # noqa: E402
from echo_kernels.reference import awq_unpack_ref  # noqa: E402

# (block_n, warps, stages)
TILES = ((16, 4, 4), (32, 4, 4), (8, 2, 4), (16, 2, 6), (32, 8, 4), (64, 4, 3))
_POSITION_SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # bit of the r-th K of an int32 (AWQ's)


def repack_n_major(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's qweight [K, N / 8], qzeros [K / G, N / 8], scales [K / G, N] -> int32 [N, K / 8]
    (the r-th nibble position of int32 j of row n holds q[8j + r, n]), uint8 zeros [N, K / G]
    and scales [N, K / G] (a byte a zero where AWQ packs two: the bytes printed are AWQ's)."""
    q = awq_unpack_ref(qweight).t()  # [N, K], 0..15
    n, k = q.shape
    words = q.reshape(n, k // 8, 8)
    packed = torch.zeros(n, k // 8, dtype=torch.int64, device=q.device)
    for r, shift in enumerate(_POSITION_SHIFTS):
        packed |= words[:, :, r] << shift
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    zeros = awq_unpack_ref(qzeros).t().to(torch.uint8).contiguous()
    return packed.contiguous(), zeros, scales.t().contiguous()


@triton.jit
def _n_major_gemv_kernel(
    x_ptr,  # [K]
    qweight_ptr,  # [N, K // 8] int32
    zeros_ptr,  # [N, K // G] uint8
    scales_ptr,  # [N, K // G] float16
    out_ptr,  # [N]
    N,
    K,
    k_words,  # K // 8: an argument, so that Triton sees its divisibility (16-byte row loads)
    one_bits,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,  # groups in flight (Triton's pipeliner)
):
    # a step is a group: its sum over K is the step's one reduction (a row's K over a few
    # lanes: shuffles), and its zero and scale are one value a row. Per weight: the unpacking,
    # w - z' and an FMA with x / u. NOTE: sum_k x_k and sum_k x_k / u as separate sums were
    # block-wide reductions through shared memory every step, and x loaded as a vector took a
    # layout conversion through shared memory (sm_90 SASS); x as a [1, G] row takes the tile's
    # layout, and z' = 1 + z u (two units, by k % 8) folds the zero in before the product
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    words = tl.arange(0, GROUP // 8)
    offs_k = tl.arange(0, GROUP)[None, :]
    inverse_units = _inverse_units(offs_k)  # [1, G], by k % 8 as _unpack_offsets' by column
    fine = inverse_units == 256.0
    groups = K // GROUP
    w_ptrs = qweight_ptr + rows[:, None].to(tl.int64) * k_words + words[None, :]
    g_ptrs = rows * groups
    total = tl.zeros([BLOCK_N], tl.float32)
    for g in tl.range(0, groups, num_stages=STAGES):
        packed = tl.load(w_ptrs + g * (GROUP // 8), mask=row_ok[:, None], other=0)
        w = tl.reshape(_unpack_offsets(packed, one_bits), (BLOCK_N, GROUP))
        xu = tl.load(x_ptr + g * GROUP + offs_k).to(tl.float32) * inverse_units  # x / u
        z = tl.load(zeros_ptr + g_ptrs + g, mask=row_ok, other=0).to(tl.float32)[:, None]
        s = tl.load(scales_ptr + g_ptrs + g, mask=row_ok, other=0.0).to(tl.float32)
        # z' = 1 + z u: x_k (q_k - z) = (x_k / u) (w_k - z')
        z_offset = tl.where(fine, 1.0 + z * (1.0 / 256.0), 1.0 + z * (1.0 / 16.0))
        total += s * tl.sum(xu * (w - z_offset), axis=1)
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def n_major_gemv(x: torch.Tensor, packed: torch.Tensor, zeros: torch.Tensor,
                 scales: torch.Tensor, group: int, block_n: int = 16, num_warps: int = 4,
                 stages: int = 4) -> torch.Tensor:
    """x [1, K] @ the repacked weight -> [1, N] in x's dtype."""
    n, k = packed.shape[0], packed.shape[1] * 8
    if k % group:
        raise ValueError(f"K={k} must be a multiple of the group ({group})")
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _n_major_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, packed, zeros, scales, out, n, k, k // 8, _ONE_BITS, GROUP=group, BLOCK_N=block_n,
        STAGES=stages, num_warps=num_warps, num_stages=stages)
    return out


def probe_shape(name: str, n: int, k: int, tiles: list[tuple[int, int, int]]) -> None:
    """awq_gemv's default, then the N-major kernel at each tile, at one layer shape."""
    from bench_kernels import AWQ_GROUP, awq_copies, bench_graph, fits

    from echo_kernels.reference import awq_linear_ref

    copies, nbytes = awq_copies(n, k)
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    expected = awq_linear_ref(x, *copies[0], AWQ_GROUP).float()
    runs = [("awq_gemv (default)", lambda *c: awq_gemv(x, *c, AWQ_GROUP), copies)]
    repacked = [repack_n_major(*c) for c in copies]
    for block_n, warps, stages in tiles:
        runs.append((f"n-major {block_n} rows {warps}w {stages}st",
                     lambda *c, t=(block_n, warps, stages): n_major_gemv(x, *c, AWQ_GROUP, *t),
                     repacked))
    for label, fn, operands in runs:
        error = (fn(*operands[0]).float() - expected).abs().max().item()
        ms = fits(lambda: bench_graph([lambda c=c: fn(*c) for c in operands]))  # noqa: B023
        us = "does not fit" if ms is None else \
            f"{ms * 1e3:7.1f} us {nbytes / (ms * 1e-3) / 1e12:5.2f} TB/s"
        print(f"{name:8s} {label:22s} {us}  max error {error / expected.abs().max().item():.1e}"
              f" of the largest output", flush=True)


def main() -> None:
    from bench_kernels import AWQ_SHAPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", default=",".join("x".join(map(str, t)) for t in TILES),
                        help="block_n x warps x stages, comma-separated")
    tiles = [tuple(int(v) for v in t.split("x")) for t in parser.parse_args().tiles.split(",")]
    for name, (n, k) in AWQ_SHAPES.items():
        probe_shape(name, n, k, tiles)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
