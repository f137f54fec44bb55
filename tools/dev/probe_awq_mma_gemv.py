"""The tensor-core AWQ GEMV (echo_kernels/awq_mma.py) against awq_linear at Llama-3.1-8B's
layer shapes, over its settings: the probe that found it (#30).

    python tools/dev/probe_awq_mma_gemv.py [--rows 1,4] [--configs 4x1,4x2] [--per-sm 4,8]
        [--ahead 1,2] [--x-shared 0,1] [--fused-sum 0,1]
    python tools/dev/probe_awq_mma_gemv.py --sass     # CPU: compile for sm_90, count SASS
    python tools/dev/probe_awq_mma_gemv.py --loads-only [--per-sm 8] [--batch 1,2,4,8]

GPU: CUDA graphs over weight copies beyond the L2, bf16 x, the largest error of each against
the float32 reference; --fused-sum 1: the splits added inside the GEMV's launch (arrival
counts) instead of by a second launch. --sass compiles the kernel for sm_90 on this machine (no
GPU), with and without the sum inside, and counts its loop's instructions a weight (awq_gemv's:
3.4), its registers and spills. --loads-only (GPU, one row) asks where the one-row GEMV's ~70%
of the copy rate at gate_up and down is lost: a kernel that loads what its loop loads (a
warp's 1 KB of a group's weights, the group's scales and zeros), on the same grid and splits,
and only XORs the words, with `batch` groups loaded at once (1: ptxas unrolls that loop and
keeps about two in flight, as the GEMV does; more: more bytes in flight a warp); if it runs
no faster than the GEMV, the loads' pattern or their count in flight bounds it, not the
dequantization or the tensor cores. Until c44a437 the kernel lived here (e257d5f, 91b0394: the
figures in docs/benchmarks.md, AWQ, 2026-12-06); from db9154a to the revert that followed its
timing (--stages) it had a shared-memory ring.
"""

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402

from echo_kernels.awq_mma import (  # noqa: E402
    _awq_mma_kernel,
    _words_layout,
    _words_offsets,
    arrival_counts,
    awq_mma_gemv,
    max_registers,
    repack_awq,
)

# (warps, tiles, rows, groups of weights in flight ahead, a split's groups of x in shared memory)
SASS_CONFIGS = [(4, 1, 8, 1, 0), (4, 1, 8, 2, 0), (4, 1, 8, 1, 4), (4, 1, 8, 2, 4),
                (8, 1, 8, 1, 0), (4, 2, 8, 1, 0), (4, 2, 8, 2, 4), (4, 2, 32, 1, 0)]


def sass() -> None:
    """Compile for sm_90 on this machine and count the loop's instructions."""
    import collections
    import re

    from sass_chain import cuobjdump, resources
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    names = ["x_ptr", "rq_ptr", "qzeros_ptr", "scales_ptr", "out_ptr", "M", "N", "K", "n_packed",
             "stride_xm", "stride_om", "stride_os", "groups_per_split", "magic", "arrivals_ptr",
             "sum_ptr", "num_splits"]
    types = ["*i32", "*i32", "*i32", "*fp16", "*fp32"] + ["i32"] * 9 + ["*i32", "*fp16", "i32"]
    for (warps, tiles, rows, ahead, x_split), (splits, swiglu) in itertools.product(
            SASS_CONFIGS, [(0, False), (16, False), (16, True)]):
        sig = dict(zip(names, types)) | {name: "constexpr" for name in (
            "GROUP", "WARPS", "TILES", "ROWS", "BF16", "USE_PDL", "AHEAD", "X_SPLIT",
            "SUM_SPLITS", "SWIGLU")}
        consts = {(17,): 128, (18,): warps, (19,): tiles, (20,): rows, (21,): True, (22,): True,
                  (23,): ahead, (24,): x_split, (25,): splits, (26,): swiglu}
        attrs = {(i,): [["tt.divisibility", 16]]
                 for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 14, 15)}
        src = GluonASTSource(fn=_awq_mma_kernel, signature=sig, constexprs=consts,
                             attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "maxnreg": max_registers(
                                      splits > 0, rows, tiles, ahead)})
        regs, spill = resources(compiled.asm["cubin"])
        text = cuobjdump(compiled.asm["cubin"], "-sass")
        lines = re.findall(r"/\*([0-9a-f]{4})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*)", text)
        # the loop: the longest from a backward branch's target to that branch
        branch = max((i for i, (_, _, op, rest) in enumerate(lines)
                      if op == "BRA" and int(rest.split()[0], 16) < int(lines[i][0], 16)),
                     key=lambda i: int(lines[i][0], 16) - int(lines[i][3].split()[0], 16))
        start = int(lines[branch][3].split()[0], 16)
        loop = [op.split(".")[0] for addr, _, op, _ in lines[:branch + 1] if int(addr, 16) >= start]
        weights = 16 * 128 * tiles // 32  # a lane's weights a group
        print(f"{warps} warps x {tiles} tiles, {rows} rows, {ahead} ahead, x of {x_split} "
              f"groups shared, sum of {splits} "
              f"splits {'with SwiGLU ' if swiglu else ''}inside: "
              f"{regs} registers, {spill} bytes of stack (spills), "
              f"loop {len(loop)} instructions, {len(loop) / weights:.2f} a weight; "
              f"{dict(collections.Counter(loop).most_common(12))}")


@gluon.jit(do_not_specialize=["groups_per_split"])
def _loads_only_kernel(rq_ptr, qzeros_ptr, scales_ptr, out_ptr, N, K, n_packed,
                       groups_per_split, GROUP: gl.constexpr, WARPS: gl.constexpr,
                       BATCH: gl.constexpr):
    """The one-row GEMV's loads (awq_mma._awq_mma_kernel at one tile a warp): each group's
    words in the same layout and order, its scales and zeros; BATCH groups loaded at once."""
    STEPS: gl.constexpr = GROUP // 16
    w_layout: gl.constexpr = _words_layout(1, WARPS, STEPS)
    c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pid_n = gl.program_id(0)
    w_offs = _words_offsets(pid_n, K, 1, WARPS, STEPS, w_layout)
    cn = pid_n * 16 * WARPS + gl.arange(0, 16 * WARPS, layout=c_layout)
    first = gl.program_id(1) * groups_per_split
    end = gl.minimum(first + groups_per_split, K // GROUP)
    folded = gl.zeros([1, WARPS, 8, STEPS, 4], gl.int32, w_layout)
    side = gl.zeros([16 * WARPS], gl.int32, c_layout)
    for group in range(first, end, BATCH):
        for j in gl.static_range(BATCH):
            g = gl.minimum(group + j, end - 1)
            folded ^= gl.load(rq_ptr + w_offs + g * (GROUP * 2))
            side ^= gl.load(scales_ptr + g * N + cn).to(gl.int32, bitcast=False)
            side ^= gl.load(qzeros_ptr + g * n_packed + cn // 8)
    total = gl.sum(gl.sum(gl.sum(gl.sum(gl.sum(folded, 4), 3), 2), 1), 0) + gl.sum(side, 0)
    gl.store(out_ptr + gl.program_id(0) * gl.num_programs(1) + gl.program_id(1), total)


def time_loads_only(per_sm: list[int], batches: list[int]) -> None:
    """Each shape: the one-row GEMV with its defaults against its loads alone (module
    docstring), on its grid and splits at each programs-an-SM count."""
    from bench_kernels import AWQ_GROUP, AWQ_SHAPES, awq_copies, bench_graph

    from echo_kernels.awq import _num_splits

    for name, (n, k) in AWQ_SHAPES.items():
        copies, nbytes = awq_copies(n, k)
        repacked = [(repack_awq(qw, AWQ_GROUP), qz, sc) for qw, qz, sc in copies]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        arrivals = [arrival_counts(n, x.device) for _ in repacked]
        ms = bench_graph([functools.partial(awq_mma_gemv, x, *c, AWQ_GROUP, a)
                          for c, a in zip(repacked, arrivals)])
        print(f"{name} {n}x{k}: awq_mma_gemv (defaults, the sum inside) {ms * 1e3:.1f} us "
              f"({nbytes / ms / 1e6:.0f} GB/s)", flush=True)
        blocks, groups = n // 64, k // AWQ_GROUP
        for programs, batch in itertools.product(per_sm, batches):
            splits, per_split = _num_splits(None, blocks, groups, programs, x.device)
            out = torch.empty(blocks * splits, dtype=torch.int32, device=x.device)
            ms = bench_graph([functools.partial(
                _loads_only_kernel[(blocks, splits)], rq, qz, sc, out, n, k, n // 8,
                per_split, GROUP=AWQ_GROUP, WARPS=4, BATCH=batch, num_warps=4)
                for rq, qz, sc in repacked])
            print(f"  loads only, {programs}/SM ({splits} splits of {per_split} groups), "
                  f"{batch} at once: {ms * 1e3:.1f} us ({nbytes / ms / 1e6:.0f} GB/s)",
                  flush=True)
        del copies, repacked
        torch.cuda.empty_cache()


def time_gpu(rows: list[int], configs: list[tuple[int, int]], per_sm: list[int],
             ahead: list[int], shared: list[int], fused: list[int]) -> None:
    """Each shape and row count (bf16 x): awq_linear, then every (warps, tiles, rows, programs
    an SM, groups ahead) of the probe, in CUDA graphs over weight copies beyond the L2, with the
    largest error of each against the float32 reference relative to its largest value."""
    from bench_kernels import AWQ_GROUP, AWQ_SHAPES, awq_copies, bench_graph

    import echo_kernels.awq as awq
    from echo_kernels.reference import awq_linear_ref

    def error(got: torch.Tensor, ref: torch.Tensor) -> float:
        return ((got.float() - ref).abs().max() / ref.abs().max()).item()

    for name, (n, k) in AWQ_SHAPES.items():
        copies, nbytes = awq_copies(n, k)
        repacked = [(repack_awq(qw, AWQ_GROUP), qz, sc) for qw, qz, sc in copies]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = awq_linear_ref(x.float(), *copies[0], AWQ_GROUP)
            base = bench_graph([functools.partial(awq.awq_linear, x, *c, AWQ_GROUP)
                                for c in copies])
            base_err = error(awq.awq_linear(x, *copies[0], AWQ_GROUP), ref)
            print(f"{name} {n}x{k} M={m} bf16: awq_linear {base * 1e3:.1f} us "
                  f"({nbytes / base / 1e6:.0f} GB/s, err {base_err:.1e})", flush=True)
            arrivals = [arrival_counts(n, x.device) for _ in repacked]
            for (warps, tiles), rows_a, programs, groups, x_shared, inside in itertools.product(
                    configs, [8] if m <= 8 else [8, 16, 32], per_sm, ahead,
                    shared if m == 1 else [0], fused):
                if n % (16 * warps * tiles) or rows_a > max(m, 8):
                    continue
                gemv = functools.partial(awq_mma_gemv, group_size=AWQ_GROUP, warps=warps,
                                         tiles=tiles, per_sm=programs, rows=rows_a,
                                         ahead=groups, x_shared=bool(x_shared))
                calls = [functools.partial(gemv, x, *c, arrivals=a if inside else None)
                         for c, a in zip(repacked, arrivals)]
                err = error(calls[0](), ref)
                ms = bench_graph(calls)
                print(f"  mma {warps} warps x {tiles} tiles, {rows_a} rows, {programs}/SM, "
                      f"{groups} ahead, x {'shared' if x_shared else 'in registers'}, split sum"
                      f" {'inside' if inside else 'launched'}: "
                      f"{ms * 1e3:.1f} us ({nbytes / ms / 1e6:.0f} GB/s, err {err:.1e})",
                      flush=True)
        del copies, repacked
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="compile for sm_90 (no GPU)")
    parser.add_argument("--loads-only", action="store_true",
                        help="one row: the GEMV's loads alone (module docstring)")
    parser.add_argument("--batch", default="1,2,4,8", help="--loads-only: groups loaded at once")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--configs", default="4x1,4x2", help="warps x tiles, ...")
    parser.add_argument("--per-sm", default="4,8", help="programs an SM the splits aim at")
    parser.add_argument("--ahead", default="1", help="groups of weights in flight ahead: 1, 2")
    parser.add_argument("--x-shared", default="1",
                        help="one row: 1, x in shared memory; 0, in registers")
    parser.add_argument("--fused-sum", default="1",
                        help="0: the split sum launched; 1: added by the last split inside")
    args = parser.parse_args()
    if args.sass:
        os.environ["TRITON_INTERPRET"] = "0"
        sass()
    elif args.loads_only:
        time_loads_only([int(p) for p in args.per_sm.split(",")],
                        [int(b) for b in args.batch.split(",")])
    else:
        configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
        time_gpu([int(r) for r in args.rows.split(",")], configs,
                 [int(p) for p in args.per_sm.split(",")],
                 [int(a) for a in args.ahead.split(",")],
                 [int(x) for x in args.x_shared.split(",")],
                 [int(f) for f in args.fused_sum.split(",")])


if __name__ == "__main__":
    main()
