"""Benchmark echo_kernels against the GPU's measured ceilings and against torch's SDPA.

Measures, in the same run, the device copy bandwidth (bytes read + written) and a bf16 matmul
rate, then times each kernel at the issue's acceptance shapes with triton.testing.do_bench
(median; L2 flushed between runs) and reports achieved TB/s or TFLOP/s, the fraction of the
ceiling and the target. Prints a table; --out writes the rows as JSON.

    python tools/bench_kernels.py [--out bench.json] [--only decode,prefill,...] [--sweep]

--sweep also times the attention shapes under several tile configs and split counts (for tuning
echo_kernels.attention.common.tile_config and the split heuristic).
"""

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo.attention.backend import cache_scales  # noqa: E402
from echo.worker.step_buffers import longest_first  # noqa: E402
from echo_kernels import (  # noqa: E402
    fused_add_rms_norm,
    fused_moe,
    moe_routing,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
    store_kv_cache,
)
from echo_kernels.attention import flash_attn_varlen, paged_attention  # noqa: E402
from echo_kernels.attention.common import TileConfig, tile_config  # noqa: E402
from echo_kernels.awq import awq_dequantize, awq_gemm, awq_gemv, awq_linear  # noqa: E402
from echo_kernels.linear import small_m_linear  # noqa: E402
from echo_kernels.reference import fused_moe_ref  # noqa: E402

DT = torch.bfloat16


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds."""
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def measure_ceilings() -> dict:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, device="cuda", dtype=DT)
    dst = torch.empty_like(src)
    copy_tbs = 2 * src.numel() * 2 / bench(lambda: dst.copy_(src)) / 1e9
    src = dst = None
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    mm_tflops = 2 * 8192**3 / bench(lambda: a @ b) / 1e9
    return {"copy_TBps": copy_tbs, "matmul_bf16_TFLOPs": mm_tflops}


class Rows:
    def __init__(self, ceilings: dict):
        self.ceil = ceilings
        self.rows: list[dict] = []

    def add(self, name: str, shape: str, ms: float, *, nbytes: float = 0, flops: float = 0,
            target: float | None = None, note: str = "") -> None:
        if flops:
            achieved, unit = flops / ms / 1e9, "TFLOP/s"
            frac = achieved / self.ceil["matmul_bf16_TFLOPs"]
        else:
            achieved, unit = nbytes / ms / 1e9, "TB/s"
            frac = achieved / self.ceil["copy_TBps"]
        row = {"kernel": name, "shape": shape, "us": ms * 1e3, "achieved": achieved,
               "unit": unit, "frac_of_ceiling": frac, "target": target, "note": note}
        if target is not None and unit == "TB/s":
            row["pass"] = frac >= target
        elif target is not None:
            row["pass"] = achieved >= target
        self.rows.append(row)
        tgt = "" if target is None else (f"{target:.0%}" if unit == "TB/s" else f">={target:.0f}")
        ok = {True: "ok", False: "MISS"}.get(row.get("pass"), "")
        print(f"{name:<34} {shape:<34} {ms * 1e3:>9.1f} us {achieved:>8.2f} {unit:<8}"
              f" {frac:>6.1%}  {tgt:>6} {ok:<4} {note}", flush=True)


# ---------------------------------------------------------------------------- attention inputs

def random_block_table(batch: int, blocks_per_seq: int, pool: int) -> torch.Tensor:
    """Distinct random blocks of a pool of `pool`, blocks_per_seq for each sequence."""
    perm = torch.randperm(pool, device="cuda", dtype=torch.int64)[: batch * blocks_per_seq]
    return perm.to(torch.int32).view(batch, blocks_per_seq)


def paged_decode_inputs(batch: int, ctx: int, heads=(32, 8), head_dim=128, block_size=16,
                        kv_dtype=DT, pool_blocks: int = 0):
    """Random distinct cache blocks for each sequence, drawn from a pool of `pool_blocks` (at
    least what the batch needs). The engine's pool fills the GPU's memory: for Qwen3-0.6B with
    int8 on an H200 that is over 2^31 cache elements, where the kernel's offsets count from the
    pool's middle block (paged.cache_offsets)."""
    num_heads, num_kv = heads
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = max(batch * blocks_per_seq, pool_blocks)
    block_table = random_block_table(batch, blocks_per_seq, num_blocks)
    shape = (num_blocks, block_size, num_kv, head_dim)
    if kv_dtype == torch.int8:
        k_cache = torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
        v_cache = torch.randint(-127, 128, shape, device="cuda", dtype=torch.int8)
        k_scale, v_scale = (cache_scales(num_blocks, block_size, num_kv, "cuda")
                            .uniform_(0, 1 / 127) for _ in range(2))  # the engine's layout
    else:
        k_cache = torch.randn(shape, device="cuda", dtype=kv_dtype)
        v_cache = torch.randn(shape, device="cuda", dtype=kv_dtype)
        k_scale = v_scale = None
    return dict(block_table=block_table, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale,
                v_scale=v_scale, seq_lens=torch.full((batch,), ctx, device="cuda",
                                                     dtype=torch.int32))


def run_paged(inp, q, cu_q, max_q, max_k, out, **kw):
    return paged_attention(q, inp["k_cache"], inp["v_cache"], inp["block_table"], cu_q,
                                  inp["seq_lens"], max_q, max_k, q.shape[-1] ** -0.5,
                                  inp["k_scale"], inp["v_scale"], out=out, **kw)


def fits(timer) -> float | None:
    """timer()'s milliseconds, or None for a swept tile config the GPU cannot hold (shared
    memory, registers): Triton refuses it at compile time, in the warm-up call."""
    try:
        return timer()
    except triton.runtime.errors.OutOfResources:
        return None


def bench_graph(fns, reps: int = 20, inner: int = 10) -> float:
    """Median ms per call of `fns` replayed from one CUDA graph, as the engine's decode runs.

    `fns` rotates over inputs that together exceed the L2, so no call reads the last one's K/V
    from cache; launch overheads, which graphs remove in serving, are not counted.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2] / (inner * len(fns))


def sdpa_fn(q, k, v, backend, causal: bool, gqa: bool):
    """A callable running SDPA on one backend, or None where that backend refuses the shapes."""
    from torch.nn.attention import sdpa_kernel

    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    try:
        fn()
        return fn
    except RuntimeError:
        return None


DECODE_SWEEP = {  # the defaults first, then one-warp variants, two-warp ones (bf16; at batch 1
    # 0.15-0.5 us faster at 256 keys, ~0.45 slower at 2,048: probe_decode_attention, H100,
    # 2026-12-07, f302e83), then the earlier 4-warp tiles
    DT: [tile_config(1, 128), TileConfig(16, 32, 1, 2),
         TileConfig(16, 32, 1, 3), TileConfig(16, 64, 1, 2), TileConfig(16, 16, 1, 4),
         TileConfig(16, 32, 2, 4), TileConfig(16, 32, 2, 2),
         TileConfig(16, 32, 4, 3), TileConfig(16, 64, 4, 3)],
    torch.int8: [tile_config(1, 128, is_int8=True), TileConfig(16, 32, 1, 2),
                 TileConfig(16, 32, 1, 4), TileConfig(16, 64, 1, 2), TileConfig(16, 64, 1, 3),
                 TileConfig(16, 32, 1, 3, maxnreg=168), TileConfig(16, 16, 1, 4),
                 TileConfig(16, 128, 4, 2, maxnreg=168, programs_per_sm=3)],
}


# (batch, shortest, longest context): target fraction of the copy bandwidth. Mixed lengths are
# drawn uniformly (seeded); their programs start longest first, as the engine launches them.
DECODE_CASES = {(64, 4096, 4096): 0.85, (1, 32768, 32768): 0.70, (256, 1024, 1024): 0.85,
                (8, 32768, 32768): None, (256, 300, 1224): None, (128, 100, 4096): None}


def decode_case(text: str) -> tuple[int, int, int]:
    """'B:L' (every context L) or 'B:LO-HI' (contexts uniform in [LO, HI])."""
    batch, ctx = text.split(":")
    lo, _, hi = ctx.partition("-")
    return int(batch), int(lo), int(hi or lo)


def bench_decode(rows: Rows, sweep: bool, only_cases: str | None = None,
                 heads: tuple[int, int] = (32, 8), pool_blocks: int = 0) -> None:
    """Paged decode (bf16 and int8 caches) against dense SDPA. B=8 x 32768 is the int8 issue's
    case: int8 must take at most 1/1.7 of the bf16 time."""
    from torch.nn.attention import SDPBackend

    cases = DECODE_CASES
    if only_cases:
        cases = {decode_case(c): None for c in only_cases.split(",")}
    for (batch, lo, ctx), target in cases.items():
        lens = torch.randint(lo, ctx + 1, (batch,), generator=torch.Generator().manual_seed(0),
                             dtype=torch.int32)
        order = torch.from_numpy(longest_first(lens.numpy())).cuda()
        keys = int(lens.sum())
        num_heads, num_kv = heads
        kv_bytes = keys * num_kv * 128 * 2 * 2
        num_rot = max(1, math.ceil(512e6 / kv_bytes))  # inputs in rotation: >= 512 MB in all
        q = torch.randn(batch, num_heads, 128, device="cuda", dtype=DT)
        out = torch.empty_like(q)
        cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        shape = (f"B={batch} L={ctx if lo == ctx else f'{lo}-{ctx}'} {num_heads}/{num_kv} d128 "
                 f"bs16" + (f" pool {pool_blocks}" if pool_blocks else ""))
        for kv_dtype in (DT, torch.int8):
            if pool_blocks:  # one engine-sized cache; each input draws its own blocks from it
                first = paged_decode_inputs(batch, ctx, heads, kv_dtype=kv_dtype,
                                            pool_blocks=pool_blocks)
                inps = [{**first, "block_table": random_block_table(
                    batch, first["block_table"].shape[1], first["k_cache"].shape[0])}
                    for _ in range(num_rot)]
            else:
                inps = [paged_decode_inputs(batch, ctx, heads, kv_dtype=kv_dtype)
                        for _ in range(num_rot)]
            for inp in inps:
                inp["seq_lens"] = lens.cuda()
            elem = 1 if kv_dtype == torch.int8 else 2
            nbytes = keys * num_kv * 128 * 2 * elem + (keys * num_kv * 2 * 4 if elem == 1 else 0)

            def calls(**kw):
                return [lambda i=i: run_paged(i, q, cu_q, 1, ctx, out,  # noqa: B023
                                              seq_order=order, **kw)  # noqa: B023
                        for i in inps]  # noqa: B023

            name = "paged_attention decode" + (" int8" if elem == 1 else "")
            rows.add(name, shape, bench_graph(calls()),
                     nbytes=nbytes, target=target if elem == 2 else None, note="cuda graph")
            rows.add(name + " (eager)", shape,
                     bench(calls()[0]), nbytes=nbytes, note="do_bench, launch overhead incl.")
            if sweep:
                for splits in (1, 2, 4, 8, 16, 32, 64):
                    if batch * num_kv * splits > 8 * 132 * 8:
                        continue
                    for cfg in DECODE_SWEEP[kv_dtype]:
                        ms = bench_graph(calls(num_splits=splits, config=cfg), reps=10)
                        rows.add("  sweep", f"splits={splits} {cfg}", ms, nbytes=nbytes)
            inps = None
        if lo != ctx:
            continue  # dense SDPA has no per-sequence lengths
        # dense decode in SDPA for comparison
        qd = q.view(batch, num_heads, 1, 128)
        kd = torch.randn(batch, num_kv, ctx, 128, device="cuda", dtype=DT)
        vd = torch.randn_like(kd)
        for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("flash", SDPBackend.FLASH_ATTENTION)):
            fn, note = sdpa_fn(qd, kd, vd, backend, False, True), "enable_gqa"
            if fn is None:
                group = num_heads // num_kv
                ke, ve = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
                fn, note = (sdpa_fn(qd, ke, ve, backend, False, False),
                            f"K/V expanded to {num_heads} heads")
            if fn is not None:
                rows.add(f"sdpa {label} decode (dense)",
                         f"B={batch} L={ctx} {num_heads}/{num_kv} d128",
                         bench_graph([fn]), nbytes=kv_bytes, note=note + ", cuda graph")


def bench_prefill(rows: Rows, sweep: bool) -> None:
    from torch.nn.attention import SDPBackend

    seq, h, hkv, d = 4096, 32, 8, 128
    flops = 4 * seq * seq * h * d / 2
    q = torch.randn(seq, h, d, device="cuda", dtype=DT)
    k = torch.randn(seq, hkv, d, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    cu = torch.tensor([0, seq], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def varlen(cfg=None):
        return flash_attn_varlen(q, k, v, cu, cu, seq, seq, d**-0.5, True, out=out,
                                        config=cfg)

    rows.add("flash_attn_varlen causal", f"S={seq} {h}/{hkv} d{d}", bench(varlen), flops=flops,
             target=400)
    inp = paged_decode_inputs(1, seq)
    store_kv_cache(k, v, inp["k_cache"], inp["v_cache"],
                   (inp["block_table"][0].long()[:, None] * 16
                    + torch.arange(16, device="cuda")).flatten())

    def paged(cfg=None, splits=None):
        return run_paged(inp, q, cu, seq, seq, out, config=cfg, num_splits=splits)

    rows.add("paged_attention prefill", f"S={seq} {h}/{hkv} d{d} bs16", bench(paged),
             flops=flops, target=400)
    if sweep:
        for cfg in (TileConfig(128, 64, 8, 2), TileConfig(128, 64, 8, 3),
                    TileConfig(128, 64, 8, 4), TileConfig(128, 128, 8, 2),
                    TileConfig(128, 128, 8, 3), TileConfig(128, 32, 4, 3),
                    TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 4)):
            for label, fn in (("varlen", varlen), ("paged", paged)):
                try:
                    ms = bench(lambda: fn(cfg))  # noqa: B023
                except Exception as e:  # a config can exceed shared memory
                    print(f"  sweep {label} {cfg}: {type(e).__name__}")
                    continue
                rows.add(f"  sweep {label}", str(cfg), ms, flops=flops)
    qs = q.view(1, seq, h, d).transpose(1, 2)
    ks = k.view(1, seq, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    vs = v.view(1, seq, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("flash", SDPBackend.FLASH_ATTENTION)):
        fn = sdpa_fn(qs, ks, vs, backend, True, False)
        if fn is not None:
            rows.add(f"sdpa {label} causal", f"S={seq} {h}/{h} d{d}", bench(fn), flops=flops)


def bench_mixed(rows: Rows) -> None:
    """One launch over 64 decodes (ctx 4096) + 2 prefill chunks of 1024 over 1024-token prefixes,
    against the decode-only and prefill-only launches of the same work."""
    n_dec, ctx, chunk = 64, 4096, 1024
    inp = paged_decode_inputs(n_dec + 2, ctx)
    inp["seq_lens"][n_dec:] = 2 * chunk
    q_lens = [1] * n_dec + [chunk, chunk]
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(sum(q_lens)), 32, 128, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    mixed = bench_graph([lambda: run_paged(inp, q, cu, chunk, ctx, out)])
    dec = {k: (v[:n_dec] if k in ("block_table", "seq_lens") else v) for k, v in inp.items()}
    pre = {k: (v[n_dec:] if k in ("block_table", "seq_lens") else v) for k, v in inp.items()}
    cu_pre = cu[n_dec:] - n_dec
    t_dec = bench_graph([lambda: run_paged(dec, q[:n_dec], cu[:n_dec + 1], 1, ctx, out[:n_dec])])
    t_pre = bench_graph([lambda: run_paged(pre, q[n_dec:], cu_pre, chunk, 2 * chunk,
                                           out[n_dec:])])
    nbytes = n_dec * ctx * 8 * 128 * 4
    flops = 2 * 4 * chunk * (chunk + chunk / 2) * 32 * 128
    rows.add("paged_attention mixed (1 launch)", f"{n_dec}x dec@{ctx} + 2x {chunk}@{2 * chunk}",
             mixed, nbytes=nbytes, note=f"decode-only {t_dec * 1e3:.0f} us + prefill-only "
             f"{t_pre * 1e3:.0f} us; TB/s counts decode KV only; prefill {flops / 1e9:.0f} GFLOP")


def bench_elementwise(rows: Rows) -> None:
    tokens, hidden = 8192, 4096
    x = torch.randn(tokens, hidden, device="cuda", dtype=DT)
    residual = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DT)
    size = x.numel() * 2
    rows.add("rms_norm", f"[{tokens}, {hidden}]", bench(lambda: rms_norm(x, w, 1e-6)),
             nbytes=2 * size)
    rows.add("fused_add_rms_norm", f"[{tokens}, {hidden}]",
             bench(lambda: fused_add_rms_norm(x, residual, w, 1e-6)), nbytes=4 * size, target=0.8)
    rows.add("torch rms_norm (eager)", f"[{tokens}, {hidden}]",
             bench(lambda: F.rms_norm(x, (hidden,), w, 1e-6)), nbytes=2 * size)

    gate_up = torch.randn(tokens, 2 * hidden, device="cuda", dtype=DT)
    rows.add("silu_and_mul", f"[{tokens}, {2 * hidden}] -> {hidden}",
             bench(lambda: silu_and_mul(gate_up)), nbytes=3 * size, target=0.8)
    rows.add("torch silu*mul (eager)", f"[{tokens}, {2 * hidden}] -> {hidden}",
             bench(lambda: F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:]), nbytes=3 * size)

    h, hkv, d = 32, 8, 128
    qkv = torch.randn(tokens, (h + 2 * hkv) * d, device="cuda", dtype=DT)
    q = qkv[:, : h * d].view(tokens, h, d)
    k = qkv[:, h * d: (h + hkv) * d].view(tokens, hkv, d)
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    inv = 1.0 / 1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    freqs = torch.outer(torch.arange(32768, device="cuda").float(), inv)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
    qk_bytes = 2 * tokens * (h + hkv) * d * 2 + tokens * d * 4
    rows.add("rotary_embedding", f"T={tokens} {h}/{hkv} d{d}",
             bench(lambda: rotary_embedding(positions, q, k, cos_sin)), nbytes=qk_bytes,
             target=0.8)
    qn = torch.rand(d, device="cuda", dtype=DT) + 0.5
    rows.add("rotary_embedding + q/k norm", f"T={tokens} {h}/{hkv} d{d}",
             bench(lambda: rotary_embedding(positions, q, k, cos_sin, True, qn, qn)),
             nbytes=qk_bytes, target=0.8)

    kv = torch.randn(tokens, 2, hkv, d, device="cuda", dtype=DT)
    slots = torch.randperm(tokens * 4, device="cuda")[:tokens]
    for kv_dtype in (DT, torch.int8):
        kc = torch.zeros(tokens * 4 // 16, 16, hkv, d, device="cuda", dtype=kv_dtype)
        vc = torch.zeros_like(kc)
        sc = [torch.zeros(kc.shape[:3], device="cuda") for _ in range(2)] \
            if kv_dtype == torch.int8 else [None, None]
        elem = kc.element_size()
        nbytes = tokens * hkv * d * 2 * (2 + elem) + (tokens * hkv * 8 if elem == 1 else 0)
        rows.add("store_kv_cache" + (" int8" if elem == 1 else ""), f"T={tokens} {hkv} d{d}",
                 bench(lambda: store_kv_cache(kv[:, 0], kv[:, 1], kc, vc, slots, *sc)),  # noqa: B023
                 nbytes=nbytes)


LINEAR_SWEEP = [(bn, bk, prefetch, warps) for bn in (4, 8, 16) for bk in (256, 512, 1024)
                for prefetch in (False, True) for warps in (2, 4, 8)]
LINEAR_SHAPES = {  # name: (N, K): Llama-3.1-8B, then Qwen3-8B's own (its qkv and o_proj
    # are Llama's); at TP=2, what one rank multiplies
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
    "qwen3-8b gate_up": (24576, 4096), "qwen3-8b down": (4096, 12288),
    "qwen3-8b tp2 qkv": (3072, 4096), "qwen3-8b tp2 o_proj": (4096, 2048),
    "qwen3-8b tp2 gate_up": (12288, 4096), "qwen3-8b tp2 down": (4096, 6144),
}


def bench_linear(rows: Rows, sweep: bool) -> None:
    """Decode at batch 1-4 is a read of every weight: cuBLAS (F.linear) against small_m_linear
    at Llama-3.1-8B's and Qwen3-8B's layer shapes and a Qwen3-8B TP=2 rank's, in CUDA graphs
    over weight copies that exceed the L2; bytes = the weight. --sweep also times
    small_m_linear's tiles, register prefetch and warps at M=1."""
    for name, (n, k) in LINEAR_SHAPES.items():
        nbytes = n * k * 2
        weights = [torch.randn(n, k, device="cuda", dtype=DT)
                   for _ in range(max(2, -(-160 * 2**20 // nbytes)))]
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=DT)
            shape = f"M={m} {n}x{k}"
            rows.add(f"torch linear {name}", shape,
                     bench_graph([lambda w=w: F.linear(x, w) for w in weights]),  # noqa: B023
                     nbytes=nbytes, note="cuda graph")
            rows.add(f"small_m_linear {name}", shape,
                     bench_graph([lambda w=w: small_m_linear(x, w)  # noqa: B023
                                  for w in weights]), nbytes=nbytes, note="cuda graph")
            if not sweep or m != 1:
                continue
            for bn, bk, prefetch, warps in LINEAR_SWEEP:
                gemv = functools.partial(small_m_linear, block_n=bn, block_k=bk,
                                         num_warps=warps, prefetch=prefetch)
                rows.add(f"small_m_linear {name} sweep", shape,
                         bench_graph([lambda w=w: gemv(x, w) for w in weights]),  # noqa: B023
                         nbytes=nbytes, note=f"block_n={bn} block_k={bk} prefetch={prefetch} "
                                             f"num_warps={warps}")
        weights = None
        torch.cuda.empty_cache()


# Qwen3-30B-A3B's experts (TP=1): 128 experts, top-8, hidden 2048, expert intermediate 768
MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE = 128, 8, 2048, 768
MOE_ROUTINGS = 4  # decode rows replayed in turn: their experts together exceed the L2
# (block_m, block_n, block_k, num_warps, num_stages) for --sweep, decode rows and larger
MOE_SWEEP_SMALL = [(16, bn, bk, w, st) for bn in (32, 64, 128) for bk in (64, 128, 256)
                   for w in (2, 4) for st in (3, 4)]
MOE_SWEEP_LARGE = [(bm, bn, bk, w, st) for bm in (16, 32, 64, 128) for bn in (64, 128)
                   for bk in (64, 128) for w in (4, 8) for st in (3, 4)]


def bench_moe(rows: Rows, sweep: set[str]) -> None:
    """fused_moe over one layer's experts at M = 1 ... 4096 tokens, from the router's logits
    (routing included; the router's own linear layer is a linear row's business: one more row
    at M <= 16 times it too, "router + fused_moe"). Small M reads the weights of the experts its
    tokens picked: bytes = those experts' gate_up + down (target 70% of copy bandwidth at M <=
    16), timed in a CUDA graph (as decode runs) over MOE_ROUTINGS inputs whose experts differ;
    large M is a grouped GEMM: flops = 2 x 3 x H x I per token and expert (target 50% of the
    bf16 matmul rate); M <= 16 both with each pair a GEMV and with sorted tiles. --sweep also
    times tile configs of the sorted tiles (fused_moe's _GEMM_CONFIGS): "small" at M <= 16,
    "large" above."""
    e, k, h, i = MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=DT) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=DT) * 0.02
    gate = torch.randn(h, e, device="cuda", dtype=DT)
    for m in (1, 2, 4, 8, 16, 64, 256, 1024, 4096):
        shape = f"M={m} E={e} k={k} {h}x{i}"
        xs = [torch.randn(m, h, device="cuda", dtype=DT) for _ in range(MOE_ROUTINGS)]
        logits = [x @ gate for x in xs]
        if m <= 16:
            touched = sum(int(torch.unique(moe_routing(lg, k, True)[1]).numel())
                          for lg in logits) / len(logits)
            measure = dict(nbytes=touched * 3 * h * i * 2, target=0.7)
            prefix = f"{touched:.1f} experts touched, cuda graph"
        else:
            measure = dict(flops=2 * 3 * h * i * m * k,
                           target=0.5 * rows.ceil["matmul_bf16_TFLOPs"])
            prefix = ""
        # decode rows: pair GEMVs and sorted tiles after moe_routing (fused_moe picks by the
        # pair count)
        configs = [{"pairs": True}, {"pairs": False}] if m <= 16 else [{}]
        if ("small" if m <= 16 else "large") in sweep:
            configs += [dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages"), c),
                             pairs=False)
                        for c in (MOE_SWEEP_SMALL if m <= 16 else MOE_SWEEP_LARGE)]
        for tiles in configs:
            note = " ".join(f"{key}={value}" for key, value in tiles.items())
            ms = fits(lambda: time_fused_moe(xs, logits, w13, w2, k,  # noqa: B023
                                             graph=m <= 16, **tiles))  # noqa: B023
            if ms is not None:
                swept = set(tiles) - {"pairs"}
                rows.add("fused_moe sweep" if swept else "fused_moe", shape, ms, **measure,
                         note=f"{prefix} {note}".strip())
        if m <= 16:
            ms = time_fused_moe(xs, [None] * len(xs), w13, w2, k, graph=True, gate=gate)
            rows.add("router + fused_moe", shape, ms, **measure, note=f"{prefix} x @ gate")
        if m <= 64:  # the reference loops over experts: a point of comparison, not a target
            x, (weights, ids) = xs[0], moe_routing(logits[0], k, True)
            rows.add("fused_moe_ref (torch)", shape,
                     bench(lambda: fused_moe_ref(x, w13, w2, weights, ids),  # noqa: B023
                           rep=20), flops=2 * 3 * h * i * m * k)


def time_fused_moe(xs, logits, w13, w2, top_k: int, graph: bool, gate=None,
                   **tiles) -> float:
    """ms per fused_moe call with its routing (moe_routing) from `logits` (or from x @ gate
    where `gate` is given): in a CUDA graph over every x in turn, or with do_bench on the
    first."""
    def call(x, lg):
        lg = x @ gate if gate is not None else lg
        return fused_moe(x, w13, w2, *moe_routing(lg, top_k, True), **tiles)

    fns = [functools.partial(call, x, lg) for x, lg in zip(xs, logits)]
    return bench_graph(fns) if graph else bench(fns[0])


AWQ_GROUP = 128
AWQ_SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
              "down": (4096, 14336)}  # (N, K) of Llama-3.1-8B's layers
# awq_gemm against the dense weight and cuBLAS (awq_linear's LINEAR_GEMM_ROWS), not in graphs
AWQ_PREFILL_ROWS = (16, 32, 48, 64, 256, 1024, 4096)
# --sweep (--awq-sweep picks the parts): "gemv", awq_gemv at M = 1 over (block_n, block_k,
# num_warps, num_stages) and the programs per SM its split-K aims for, at least a pack of 8
# columns a lane; "decode", decode rows (M = 1, 16) through awq_gemm, the tensor-core
# kernel, one 16-row tile with (block_n, block_k, num_stages, split_k); "prefill", awq_gemm's
# (block_m, block_n, block_k, num_warps, num_stages) at M = 4096
AWQ_GEMV_SWEEP = [(bn, bk, w, st, per_sm) for bn in (256, 512, 1024) for w in (1, 2, 4)
                  for bk in (8, 16, 32) for st in (3, 5) for per_sm in (4, 8, 16)
                  if bn >= 256 * w]
AWQ_DECODE_SWEEP = [(bn, bk, st, sk) for bn in (64, 128, 256) for bk in (64, 128)
                    for st in (2, 3, 4) for sk in (1, 2, 4, 8, 16)]
AWQ_GEMM_SWEEP = [(bm, bn, bk, w, 3) for bm in (64, 128) for bn in (128, 256)
                  for bk in (64, 128) for w in (4, 8)]


def random_awq(n: int, k: int):
    """Random AWQ tensors (qweight, qzeros, scales) of an [K, N] weight: any bits will do."""
    g = k // AWQ_GROUP
    qweight = torch.randint(-2**31, 2**31 - 1, (k, n // 8), device="cuda", dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (g, n // 8), device="cuda", dtype=torch.int32)
    scales = torch.rand(g, n, device="cuda", dtype=torch.float16) * 0.01
    return qweight, qzeros, scales


def awq_copies(n: int, k: int) -> tuple[list, int]:
    """Enough copies of random AWQ tensors of an [K, N] weight that together they exceed the
    L2 (the decode rows rotate over them), and the bytes one copy reads: packed weight, zeros
    and scales."""
    groups = k // AWQ_GROUP
    nbytes = k * n // 2 + groups * n * 2 + groups * n // 2
    return [random_awq(n, k) for _ in range(max(2, -(-160 * 2**20 // nbytes)))], nbytes


def time_awq_decode(rows: Rows, label: str, kernel, x, copies, shape: str, nbytes: int,
                    note: str) -> None:
    """One swept AWQ config at decode rows, in CUDA graphs over the weight copies (skipped when
    the GPU cannot hold its tiles)."""
    ms = fits(lambda: bench_graph([lambda c=c: kernel(x, *c, AWQ_GROUP) for c in copies]))
    if ms is not None:
        rows.add(label, shape, ms, nbytes=nbytes, note=note)


def bench_awq(rows: Rows, sweep: set[str]) -> None:
    """AWQ W4A16 at Llama-3.1-8B's layer shapes, fp16 activations (AutoAWQ's dtype). Decode
    rows (M = 1 ... 16: awq_linear, and from 2 rows awq_gemv and awq_gemm both) read the packed
    weight, zeros and scales: bytes = those, against cuBLAS bf16 over its 4x larger weight, in
    CUDA graphs over weight copies that exceed the L2. AWQ_PREFILL_ROWS: flops of awq_gemm,
    the dense weight and awq_linear, target 70% of cuBLAS bf16 at the same shape in the same
    run (for awq_linear)."""
    for name, (n, k) in AWQ_SHAPES.items():
        copies, nbytes = awq_copies(n, k)
        dense = [torch.randn(n, k, device="cuda", dtype=DT) for _ in range(2)]
        for m in (1, 2, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            shape = f"M={m} {n}x{k} G={AWQ_GROUP}"
            rows.add(f"torch linear bf16 {name}", shape,
                     bench_graph([lambda w=w: F.linear(x.to(DT), w) for w in dense]),  # noqa: B023
                     nbytes=n * k * 2, note="cuda graph")
            rows.add(f"awq_linear {name}", shape,
                     bench_graph([lambda c=c: awq_linear(x, *c, AWQ_GROUP)  # noqa: B023
                                  for c in copies]), nbytes=nbytes, target=0.7, note="cuda graph")
            if m > 1:  # both kernels at the rows where awq_linear picks one of them
                for label, kernel in (("awq_gemv", awq_gemv), ("awq_gemm", awq_gemm)):
                    time_awq_decode(rows, f"{label} {name}", kernel, x, copies, shape, nbytes,
                                    "cuda graph")
            if "gemv" in sweep and m == 1:
                for bn, bk, w, st, per_sm in AWQ_GEMV_SWEEP:
                    sk = max(1, per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                             // -(-n // bn))
                    gemv = functools.partial(awq_gemv, block_n=bn, block_k=bk, num_warps=w,
                                             num_stages=st, split_k=sk)
                    time_awq_decode(rows, f"awq_gemv {name} sweep", gemv, x, copies, shape,
                                    nbytes, f"block_n={bn} block_k={bk} num_warps={w} "
                                            f"num_stages={st} split_k={sk}")
            if "decode" in sweep and m in (1, 16):
                for bn, bk, st, sk in AWQ_DECODE_SWEEP:
                    gemm = functools.partial(awq_gemm, block_m=16, block_n=bn, block_k=bk,
                                             num_warps=4, num_stages=st, split_k=sk)
                    time_awq_decode(rows, f"awq_gemm {name} sweep", gemm, x, copies, shape,
                                    nbytes, f"block_m=16 block_n={bn} block_k={bk} "
                                            f"num_stages={st} split_k={sk}")
        qweight, qzeros, scales = copies[0]
        for m in AWQ_PREFILL_ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            shape = f"M={m} {n}x{k} G={AWQ_GROUP}"
            flops = 2 * m * n * k
            xb = x.to(DT)
            cublas_ms = bench(lambda: F.linear(xb, dense[0]))  # noqa: B023
            rows.add(f"torch linear bf16 {name}", shape, cublas_ms, flops=flops)
            target = 0.7 * flops / cublas_ms / 1e9
            rows.add(f"awq_gemm {name}", shape,
                     bench(lambda: awq_gemm(x, qweight, qzeros, scales, AWQ_GROUP)),  # noqa: B023
                     flops=flops, note="tiles dequantized on chip")
            rows.add(f"awq dense {name}", shape,
                     bench(lambda: x @ awq_dequantize(qweight, qzeros, scales,  # noqa: B023
                                                      AWQ_GROUP, torch.float16)),
                     flops=flops, note="awq_dequantize, then cuBLAS")
            rows.add(f"awq_linear {name}", shape,
                     bench(lambda: awq_linear(x, qweight, qzeros, scales, AWQ_GROUP)),  # noqa: B023
                     flops=flops, target=target, note="70% of cuBLAS bf16")
        if "prefill" in sweep:
            for bm, bn, bk, w, st in AWQ_GEMM_SWEEP:  # at the last of AWQ_PREFILL_ROWS
                gemm = functools.partial(awq_gemm, block_m=bm, block_n=bn, block_k=bk,
                                         num_warps=w, num_stages=st)
                ms = fits(lambda: bench(lambda: gemm(x, qweight, qzeros, scales,  # noqa: B023
                                                     AWQ_GROUP)))
                if ms is not None:
                    rows.add(f"awq_gemm {name} sweep", shape, ms, flops=flops, target=target,
                             note=f"block_m={bm} block_n={bn} block_k={bk} num_warps={w} "
                                  f"num_stages={st}")
        copies = dense = None
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    parser.add_argument("--decode-cases",
                        help="B:L or B:LO-HI (mixed contexts), comma-separated, instead of every "
                             "decode case")
    parser.add_argument("--decode-heads", default="32:8",
                        help="query:KV heads of the decode cases (Qwen3-0.6B: 16:8)")
    parser.add_argument("--decode-pool-blocks", type=int, default=0,
                        help="draw decode blocks from a cache of this many 16-token blocks, as "
                             "large as the engine's (default: what the batch needs)")
    parser.add_argument("--only",
                        default="decode,prefill,mixed,elementwise,linear,moe,awq")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep tile configs (attention, linear, moe, awq)")
    parser.add_argument("--moe-sweep", default="small,large",
                        help="with --sweep: which fused_moe rows to sweep (M <= 16, larger)")
    parser.add_argument("--awq-sweep", default="gemv,decode,prefill",
                        help="the AWQ parts --sweep covers (see AWQ_GEMV_SWEEP)")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_kernels needs a CUDA GPU"
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    print(f"# {torch.cuda.get_device_name()}: copy {ceilings['copy_TBps']:.2f} TB/s, "
          f"bf16 matmul {ceilings['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    print(f"{'kernel':<34} {'shape':<34} {'time':>12} {'achieved':>17} {'ceil':>7}  target")
    rows = Rows(ceilings)
    parts = set(args.only.split(","))
    if "decode" in parts:
        heads = tuple(map(int, args.decode_heads.split(":")))
        bench_decode(rows, args.sweep, args.decode_cases, heads, args.decode_pool_blocks)
    if "prefill" in parts:
        bench_prefill(rows, args.sweep)
    if "mixed" in parts:
        bench_mixed(rows)
    if "elementwise" in parts:
        bench_elementwise(rows)
    if "linear" in parts:
        bench_linear(rows, args.sweep)
    if "moe" in parts:
        bench_moe(rows, set(args.moe_sweep.split(",")) if args.sweep else set())
    if "awq" in parts:
        bench_awq(rows, set(args.awq_sweep.split(",")) if args.sweep else set())
    missed = [r["kernel"] for r in rows.rows if r.get("pass") is False]
    print(f"# targets missed: {', '.join(missed) if missed else 'none'}")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                        "ceilings": ceilings, "rows": rows.rows}, indent=1,
                                       default=lambda o: None if isinstance(o, float)
                                       and math.isnan(o) else str(o)))


if __name__ == "__main__":
    main()
