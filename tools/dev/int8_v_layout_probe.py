"""Probe for the int8 issue: where does int8 decode attention lose its bandwidth?

    python tools/dev/int8_v_layout_probe.py [--experiment v-layout|cache-layout|overheads]

A stripped decode kernel (no masks, no split merge, int8 scales only where said; 32/8 heads,
d=128, block 16, random block tables) times int8 K/V with V stored token-major, as echo's cache
does, against V stored head-dim-major ([blocks, heads, d, block], tokens contiguous), which lets
V reach the MMA through ldmatrix instead of one shared-memory byte load per element (sm_90
SASS), and integer MMAs (q quantised per row; p per row and tile, V head-dim-major) against
float16 products.
`--experiment overheads` adds to the loop what paged_attention has and the probe lacks: the
int8 scales (applied as paged_attention applies them), PDL launches (ECHO_PDL) and
paged_attention's launch order (a split's KV heads one after another), each alone and together.
`--experiment cache-layout` compares, for int8 and bf16 alike, echo's token-major
blocks ([blocks, block, heads, d]: a program's K row is one 128-byte piece of int8, 1 KiB from
the next token's) with head-major blocks ([blocks, heads, block, d]: 16 tokens of one head in one
contiguous 2 KiB piece of int8).
Prints microseconds per call (CUDA graph over 4 caches in rotation) for several tiles and
split counts. Speed only: the integer products' accuracy is not checked here.
"""

import argparse

import torch
import triton
import triton.language as tl

from echo_kernels.attention.common import int8_to_fp16
from echo_kernels.pdl import wait_for_inputs

BS, D, KV_HEADS, GROUP = 16, 128, 8, 4


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, out_ptr, ks_ptr, vs_ptr, tiles_per_prog,
                   max_blocks, skb, skt, skh, svb, svh, svd, svt, ssb, sst, ssh,
                   HEAD_DIM_MAJOR_V: tl.constexpr, IS_INT8: tl.constexpr, SPLITS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                   GROUP: tl.constexpr, INT8_QK: tl.constexpr, INT8_PV: tl.constexpr,
                   SCALES: tl.constexpr, USE_PDL: tl.constexpr, HEADS_FIRST: tl.constexpr):
    wait_for_inputs(USE_PDL)
    pid = tl.program_id(0)
    if HEADS_FIRST:  # paged_attention's launch order: a split's 8 KV heads one after another
        kvh = pid % 8
        split = (pid // 8) % SPLITS
    else:
        split = pid % SPLITS
        kvh = (pid // SPLITS) % 8
    seq = pid // (SPLITS * 8)
    offs_m = tl.arange(0, 16)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (seq * 32 + kvh * GROUP + offs_m[:, None]) * D + offs_d[None, :],
                mask=(offs_m < GROUP)[:, None], other=0.0).to(tl.float16)
    if INT8_QK:  # q quantised per row once; the scores come from integer MMAs on int8 K
        q_scale = tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-6) / 127
        q8 = tl.extra.cuda.libdevice.rint(q.to(tl.float32) / q_scale[:, None]).to(tl.int8)
    acc = tl.zeros([16, D], tl.float32)
    m_i = tl.full([16], -1e30, tl.float32)
    l_i = tl.zeros([16], tl.float32)
    bt = bt_ptr + seq * max_blocks
    lo = split * tiles_per_prog * BLOCK_N
    next_blk = tl.load(bt + lo // BS + offs_n // BS)  # block ids one tile ahead, as echo does
    for t in range(tiles_per_prog):
        start = lo + t * BLOCK_N
        blk = next_blk
        next_blk = tl.load(bt + (start + BLOCK_N) // BS + offs_n // BS)
        row = offs_n % BS
        k = tl.load(k_ptr + blk[:, None] * skb + row[:, None] * skt + kvh * skh + offs_d[None, :])
        if INT8_QK:
            qk = tl.dot(q8, tl.trans(k)).to(tl.float32) * q_scale[:, None]
        else:
            if IS_INT8:
                k = int8_to_fp16(k)
            qk = tl.dot(q, tl.trans(k.to(tl.float16)))
        if SCALES:  # as paged_attention applies int8 scales: keys' on the scores, values' on p
            sc_off = blk * ssb + row * sst + kvh * ssh
            qk = qk * tl.load(ks_ptr + sc_off)[None, :]
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_new
        if SCALES:
            p = p * tl.load(vs_ptr + sc_off)[None, :]
        if HEAD_DIM_MAJOR_V:
            v_t = tl.load(v_ptr + blk[None, :] * svb + kvh * svh + offs_d[:, None] * svd
                          + row[None, :])
            if INT8_PV:  # p quantised per row and tile; integer MMAs on int8 V
                p_scale = tl.maximum(tl.max(p, 1), 1e-30) / 127
                p8 = (p / p_scale[:, None] + 0.5).to(tl.int8)
                acc += tl.dot(p8, tl.trans(v_t)).to(tl.float32) * p_scale[:, None]
            else:
                acc = tl.dot(p.to(tl.float16), tl.trans(int8_to_fp16(v_t)), acc)
        else:
            v = tl.load(v_ptr + blk[:, None] * svb + row[:, None] * svt + kvh * svh
                        + offs_d[None, :])
            if IS_INT8:
                v = int8_to_fp16(v)
            acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)
    acc = acc / l_i[:, None]
    tl.store(out_ptr + (pid * 16 + offs_m[:, None]) * D + offs_d[None, :], acc)


def time_decode(batch: int, ctx: int, head_dim_major_v: bool, is_int8: bool, splits: int,
                block_n: int, stages: int, int8_qk: bool = False, int8_pv: bool = False,
                head_major_blocks: bool = False, scales: bool = False, pdl: bool = False,
                heads_first: bool = False, rotation: int = 4) -> float:
    """Microseconds per decode call, CUDA graph over `rotation` caches (past the L2)."""
    blocks_per_seq = ctx // BS
    num_blocks = batch * blocks_per_seq + 64
    token_major = (num_blocks, BS, KV_HEADS, D)

    def cache(shape):
        if is_int8:
            return torch.randint(-127, 127, shape, dtype=torch.int8, device="cuda")
        return torch.randn(shape, dtype=torch.bfloat16, device="cuda")

    def token_major_view(shape):
        if head_major_blocks:  # stored [blocks, heads, block, d], indexed as token-major
            return cache((num_blocks, KV_HEADS, BS, D)).transpose(1, 2)
        return cache(shape)

    caches = []
    for _ in range(rotation):
        k = token_major_view(token_major)
        v = cache((num_blocks, KV_HEADS, D, BS)) if head_dim_major_v else token_major_view(
            token_major)
        ids = torch.randperm(num_blocks - 64, device="cuda", dtype=torch.int32)
        table = torch.zeros(batch, blocks_per_seq + 64, dtype=torch.int32, device="cuda")
        table[:, :blocks_per_seq] = ids[: batch * blocks_per_seq].view(batch, blocks_per_seq)
        # the engine's scale layout (echo.attention.backend.cache_scales): block-major, then head
        ks, vs = (torch.rand(num_blocks, KV_HEADS, BS, device="cuda").div(127).transpose(1, 2)
                  for _ in range(2))
        caches.append((k, v, table, ks, vs))
    q = torch.randn(batch, 32, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch * KV_HEADS * splits * 16, D, device="cuda", dtype=torch.float32)
    grid = (batch * KV_HEADS * splits,)

    def call(k, v, table, ks, vs):
        if head_dim_major_v:
            svb, svh, svd, svt = *v.stride()[:3], 1
        else:
            svb, svt, svh, svd = *v.stride()[:3], 1
        _decode_kernel[grid](q, k, v, table, out, ks, vs, ctx // block_n // splits,
                             table.shape[1], *k.stride()[:3], svb, svh, svd, svt,
                             *ks.stride(), HEAD_DIM_MAJOR_V=head_dim_major_v, IS_INT8=is_int8,
                             SPLITS=splits, BLOCK_N=block_n, BS=BS, D=D, GROUP=GROUP,
                             INT8_QK=int8_qk, INT8_PV=int8_pv, SCALES=scales, USE_PDL=pdl,
                             HEADS_FIRST=heads_first, launch_pdl=pdl, num_warps=4,
                             num_stages=stages)

    for c in caches:
        call(*c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in caches:
            call(*c)
    return triton.testing.do_bench(graph.replay, warmup=20, rep=200) * 1e3 / rotation


def cache_layouts() -> None:
    cases = ((8, 32768, 4), (8, 32768, 8), (256, 1024, 1))
    for batch, ctx, splits in cases:
        for is_int8, tiles in ((False, ((64, 3), (32, 3))), (True, ((128, 3), (128, 2), (64, 3)))):
            for block_n, stages in tiles:
                times = [time_decode(batch, ctx, False, is_int8, splits, block_n, stages,
                                     head_major_blocks=hm) for hm in (False, True)]
                print(f"B={batch} L={ctx} splits={splits} {'int8' if is_int8 else 'bf16'} "
                      f"{block_n}x{stages}: token-major blocks {times[0]:.1f} us, "
                      f"head-major blocks {times[1]:.1f} us", flush=True)


def overheads() -> None:
    """What the real kernel has and the stripped loop lacks: int8 scales, PDL launches, and
    its launch order (a split's KV heads one after another), each alone and all together."""
    cases = ((8, 32768, 4, 128, 3), (8, 32768, 8, 128, 2), (256, 1024, 1, 128, 3))
    variants = ({}, {"scales": True}, {"pdl": True}, {"heads_first": True},
                {"scales": True, "pdl": True, "heads_first": True})
    for batch, ctx, splits, block_n, stages in cases:
        print(f"B={batch} L={ctx} splits={splits}", flush=True)
        for is_int8, tiles in ((False, (64, 3)), (True, (block_n, stages))):
            for extra in variants:
                us = time_decode(batch, ctx, False, is_int8, splits, *tiles, **extra)
                print(f"  {'int8' if is_int8 else 'bf16'} {tiles[0]}x{tiles[1]} "
                      f"{'+'.join(extra) or 'plain'}: {us:.1f} us", flush=True)


def v_layouts() -> None:
    tiles = ((128, 3), (128, 2), (64, 3), (256, 2))
    for batch, ctx, split_counts in ((8, 32768, (4, 8)), (256, 1024, (1,))):
        for splits in split_counts:
            bf16 = time_decode(batch, ctx, False, False, splits, 64, 3)
            print(f"B={batch} L={ctx} splits={splits} bf16 (64x3): {bf16:.1f} us", flush=True)
            for block_n, stages in tiles:
                times = {
                    "token-major V": time_decode(batch, ctx, False, True, splits, block_n, stages),
                    "head-dim-major V": time_decode(batch, ctx, True, True, splits, block_n,
                                                    stages),
                    "int8 QK products": time_decode(batch, ctx, False, True, splits, block_n,
                                                    stages, int8_qk=True),
                    "int8 QK+PV products, head-dim-major V": time_decode(
                        batch, ctx, True, True, splits, block_n, stages, int8_qk=True,
                        int8_pv=True),
                }
                print(f"  int8 {block_n}x{stages}: "
                      + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", choices=tuple(EXPERIMENTS), default="v-layout")
    EXPERIMENTS[parser.parse_args().experiment]()


EXPERIMENTS = {"v-layout": v_layouts, "cache-layout": cache_layouts, "overheads": overheads}


if __name__ == "__main__":
    main()
