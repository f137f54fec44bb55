"""Probe (dropped, see docs/benchmarks.md): awq_gemv at M = 1 against a variant with warps along K
in a program (v6), summed through shared memory at the end. Run from the repository root.
"""
import triton
import triton.language as tl

from echo_kernels.awq import _inverse_units, _unpack_offsets


@triton.jit(do_not_specialize=["n_packed"])
def v6(x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, out_ptr, N, n_packed, K, tiles_per_split,
       stride_xm, stride_om, stride_os, one_bits,
       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARPS_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    PACKS: tl.constexpr = BLOCK_N // 8
    ROWS: tl.constexpr = BLOCK_K * WARPS_K  # rows a tile
    TILES: tl.constexpr = GROUP // ROWS
    packs = tl.program_id(0) * PACKS + tl.arange(0, PACKS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row = tl.program_id(2)
    first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, K // ROWS)
    # row of [w, k] in a tile: k * WARPS_K + w (the warp axis steps one row, so it counts as
    # the more contiguous and takes the warps)
    tile_rows = tl.arange(0, BLOCK_K)[None, :] * WARPS_K + tl.arange(0, WARPS_K)[:, None]
    offs_k = first_tile * ROWS + tile_rows  # [W, BK]
    qw_ptrs = qweight_ptr + offs_k[:, :, None].to(tl.int64) * n_packed + packs[None, None, :]
    x_ptrs = x_ptr + row * stride_xm + offs_k
    total = tl.zeros([WARPS_K, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([WARPS_K, BLOCK_N], dtype=tl.float32)
    x_sum = tl.zeros([WARPS_K], dtype=tl.float32)
    x_next = tl.load(x_ptrs)
    for tile in tl.range(first_tile, end_tile, num_stages=NUM_STAGES):
        x = x_next.to(tl.float32)
        x_ptrs += ROWS
        x_next = tl.load(x_ptrs, mask=tile + 1 < end_tile, other=0.0)
        packed = tl.load(qw_ptrs)
        w = tl.reshape(_unpack_offsets(packed, one_bits), (WARPS_K, BLOCK_K, BLOCK_N))
        acc += tl.sum(x[:, :, None] * w, axis=1)
        x_sum += tl.sum(x, axis=1)
        if (tile % TILES == TILES - 1) | (tile == end_tile - 1):
            group = tile // TILES
            zeros = tl.load(qzeros_ptr + group * n_packed + packs)
            z = tl.reshape(_unpack_offsets(zeros, one_bits), (BLOCK_N,))
            s = tl.load(scales_ptr + group * N + cols)
            s_u = s.to(tl.float32) * _inverse_units(cols)
            total += s_u[None, :] * (acc - z[None, :] * x_sum[:, None])
            acc = tl.zeros([WARPS_K, BLOCK_N], dtype=tl.float32)
            x_sum = tl.zeros([WARPS_K], dtype=tl.float32)
        qw_ptrs += ROWS * n_packed
    y = tl.sum(total, axis=0)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + row * stride_om + cols, y)


import os
import sys

sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/tools")
import torch
import triton
from bench_kernels import AWQ_GROUP, AWQ_SHAPES, bench_graph, random_awq

from echo_kernels.awq import _ONE_BITS, _launch_split, awq_gemv
from echo_kernels.pdl import pdl_options


def v6_call(x, qw, qz, sc, g, bn, bk, wk, st, splits):
    m, k = x.shape; n = qw.shape[1] * 8
    rows = bk * wk
    tiles = triton.cdiv(k // rows, splits); num = triton.cdiv(k // rows, tiles)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = pdl_options(x.device)
    def launch(t, ss):
        v6[(triton.cdiv(n, bn), num, m)](x, qw, qz, sc, t, n, n // 8, k, tiles, x.stride(0), n, ss, _ONE_BITS,
                                        GROUP=g, BLOCK_N=bn, BLOCK_K=bk, WARPS_K=wk, NUM_STAGES=st, num_warps=wk, num_stages=st)
    _launch_split(launch, num, m, n, out, pdl)
    return out

for name, (n, k) in AWQ_SHAPES.items():
    nbytes = k * n // 2 + (k // AWQ_GROUP) * n * 2.5
    copies = [random_awq(n, k) for _ in range(max(2, -(-160 * 2**20 // int(nbytes))))]
    x = torch.randn(1, k, device="cuda", dtype=torch.float16)
    ref = awq_gemv(x, *copies[0], AWQ_GROUP).float()
    t = bench_graph([lambda c=c: awq_gemv(x, *c, AWQ_GROUP) for c in copies])
    print(f"{name} v5 default {t*1e3:.1f} us", flush=True)
    progs = triton.cdiv(n, 512)
    for wk in (2, 4):
        for bk in (4, 8):
            for per_sm in (4, 8):
                splits = max(1, per_sm * 132 // (progs * wk), k // 512)
                try:
                    got = v6_call(x, *copies[0], AWQ_GROUP, 512, bk, wk, 3, splits).float()
                    err = (got - ref).abs().max().item()
                    t = bench_graph([lambda c=c: v6_call(x, *c, AWQ_GROUP, 512, bk, wk, 3, splits) for c in copies])
                    print(f"{name} v6 wk={wk} bk={bk} splits={splits} {t*1e3:.1f} us maxdiff {err:.2e}", flush=True)
                except Exception as e:
                    print(name, "v6 fail", wk, bk, type(e).__name__, str(e)[:100])
