"""fused_moe at a few tokens: each (token, expert) pair a CUDA-core GEMV, configs and variants.

    python tools/dev/probe_moe_pair_gemv.py [--rows 1,2,4,8,16] [--quick | --whole-k]

Qwen3-30B-A3B's experts (bench_kernels' MOE_* shapes), bf16, CUDA graphs over MOE_ROUTINGS
routings (bench_kernels' bench_graph). Every row but one starts from router logits computed
beforehand (the router is the model's own linear layer):
  fused_moe            moe_routing + fused_moe with its defaults (and routing on fewer warps)
  fused_moe sorted     the same through the sorted tiles
  router + fused_moe   x @ gate (cuBLAS) first, as bench_kernels' fused_moe rows did to 32cfaf8
  gemv, separate sum   the pair GEMVs as first measured: the down GEMV writes each pair's row,
                       a third launch sums a token's k rows
  pairs g/d            fused_moe_pairs with (BLOCK_N, BLOCK_K, num_warps) g and d
--whole-k: the default gate_up tile and down tiles whose BLOCK_K covers the intermediate size
(768 in a 1,024-wide masked tile), so a down program loads all of its weights before the PDL
wait, while gate_up still runs, as small_m_linear's whole-K tiles do for dense layers (the
sweep below stops at 256).
Each row's output is checked against fused_moe_ref first. Bytes: the experts touched. The probe
also runs in trees from before fused_moe_pairs (its rows up to "gemv, separate sum"), for A/B
runs: copy it there.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_kernels import (  # noqa: E402
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_INTERMEDIATE,
    MOE_ROUTINGS,
    MOE_TOP_K,
    bench_graph,
    fits,
    measure_ceilings,
)

from echo_kernels import fused_moe, moe_routing  # noqa: E402
from echo_kernels.fused_moe import _moe_sum_kernel  # noqa: E402
from echo_kernels.pdl import pdl_options, wait_for_inputs  # noqa: E402
from echo_kernels.reference import fused_moe_ref  # noqa: E402

try:  # this probe also runs in trees from before fused_moe_pairs (for A/B runs)
    from echo_kernels.fused_moe import fused_moe_pairs
    SORTED = {"pairs": False}
except ImportError:
    fused_moe_pairs, SORTED = None, {"pair_tiles": False}


@triton.jit
def _pair_gate_up(hidden_ptr, w13_ptr, act_ptr, ids_ptr, top_k, hidden_size, inter_size,
                  stride_hm, stride_we, stride_wn,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    num_n = tl.cdiv(inter_size, BLOCK_N)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wait_for_inputs(USE_PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    token = (pair // top_k).to(tl.int64)
    g_ptrs = w13_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + inter_size * stride_wn
    x_ptrs = hidden_ptr + token * stride_hm + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        x = tl.load(x_ptrs + k0).to(tl.float32)[None, :]
        acc_g += tl.load(g_ptrs + k0).to(tl.float32) * x
        acc_u += tl.load(u_ptrs + k0).to(tl.float32) * x
    g = tl.sum(acc_g, 1)
    u = tl.sum(acc_u, 1)
    act = g / (1.0 + tl.math.exp2(-g * 1.4426950408889634)) * u
    tl.store(act_ptr + pair.to(tl.int64) * inter_size + cols, act.to(act_ptr.dtype.element_ty))


@triton.jit
def _pair_down(act_ptr, w2_ptr, weights_ptr, ids_ptr, out_ptr, hidden_size, inter_size,
               stride_we, stride_wn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    num_n = tl.cdiv(hidden_size, BLOCK_N)
    pair = (tl.program_id(0) // num_n).to(tl.int64)
    cols = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wait_for_inputs(USE_PDL)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    w_ptrs = w2_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    a_ptrs = act_ptr + pair * inter_size + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        acc += tl.load(w_ptrs + k0).to(tl.float32) * tl.load(a_ptrs + k0).to(tl.float32)[None, :]
    y = tl.sum(acc, 1) * tl.load(weights_ptr + pair)
    tl.store(out_ptr + pair * hidden_size + cols, y.to(out_ptr.dtype.element_ty))


# (block_n, block_k, num_warps) swept for each kernel
GATE_UP_CONFIGS = [(bn, bk, w) for bn in (2, 4, 8) for bk in (256, 512, 1024) for w in (1, 2, 4)
                   if bn * bk <= 4096]
DOWN_CONFIGS = [(8, 128, 2)] + [(bn, bk, w) for bn in (4, 8, 16) for bk in (128, 256)
                                for w in (1, 2, 4) if (bn, bk, w) != (8, 128, 2)]
QUICK = {"gate_up": [(4, 512, 2), (8, 256, 2)], "down": [(8, 128, 2), (4, 256, 2)]}
# BLOCK_N x 1,024 on a warp count that keeps the float32 products at 64 a thread or fewer
WHOLE_K = {"gate_up": [(2, 256, 1)], "down": [(8, 128, 2)] + [
    (bn, 1024, w) for bn in (2, 4, 8) for w in (1, 2, 4) if bn * 1024 // (32 * w) <= 64]}


def gemv_moe(x, w13, w2, weights, ids, gate_up, down):
    """The chain after routing as the first run measured it: gate_up GEMV, down GEMV, sum."""
    m, h = x.shape
    e, two_i, _ = w13.shape
    i, k = two_i // 2, ids.shape[1]
    pdl = pdl_options(x.device)
    act = torch.empty(m * k, i, dtype=x.dtype, device=x.device)
    bn, bk, warps = gate_up
    _pair_gate_up[(m * k * (i // bn),)](x, w13, act, ids, k, h, i, x.stride(0), w13.stride(0),
                                        w13.stride(1), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                        **pdl)
    out = torch.empty(m, h, dtype=x.dtype, device=x.device)
    bn, bk, warps = down
    rows = torch.empty(m * k, h, dtype=x.dtype, device=x.device)
    _pair_down[(m * k * (h // bn),)](act, w2, weights, ids, rows, h, i, w2.stride(0),
                                     w2.stride(1), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                     **pdl)
    block = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(m, triton.cdiv(h, block))](rows, out, h, out.stride(0), TOP_K=k,
                                                 BLOCK=block, num_warps=4, **pdl)
    return out


def probe(m: int, w13, w2, gate, copy_tbs: float, gate_ups, downs) -> None:
    """Every row at M = m tokens."""
    k, h, i = MOE_TOP_K, MOE_HIDDEN, MOE_INTERMEDIATE
    xs = [torch.randn(m, h, device="cuda", dtype=w13.dtype) for _ in range(MOE_ROUTINGS)]
    logits = [x @ gate for x in xs]
    touched = sum(int(torch.unique(moe_routing(lg, k, True)[1]).numel())
                  for lg in logits) / len(logits)
    nbytes = touched * 3 * h * i * 2

    def row(name, chain):
        x, lg = xs[0], logits[0]
        want = fused_moe_ref(x, w13, w2, *moe_routing(lg, k, True)).float()
        err = ((chain(x, lg).float() - want).abs().max() / want.abs().max()).item()
        if err > 2e-2:
            print(f"M={m} {name}: WRONG, max error {err:.3g} of the largest output")
            return None
        ms = fits(lambda: bench_graph([lambda x=x, lg=lg: chain(x, lg)
                                       for x, lg in zip(xs, logits)]))
        if ms is not None:
            print(f"{ROOT.name} M={m:<3} ({touched:5.1f} experts) {name:<34} {ms * 1e3:7.1f} us "
                  f"{nbytes / ms / 1e9 / copy_tbs:6.1%} of copy", flush=True)
        return ms

    def routed(fn, **kw):
        return lambda x, lg: fn(x, w13, w2, *moe_routing(lg, k, True), **kw)

    row("fused_moe", routed(fused_moe))
    if fused_moe_pairs is not None:
        for warps in (1, 2):
            row(f"fused_moe, routing {warps} warps", lambda x, lg, w=warps: fused_moe(
                x, w13, w2, *moe_routing(lg, k, True, num_warps=w)))
    row("fused_moe sorted", routed(fused_moe, **SORTED))
    row("router + fused_moe", lambda x, lg: routed(fused_moe)(x, x @ gate))
    row("gemv, separate sum", routed(gemv_moe, gate_up=(4, 512, 2), down=(8, 128, 2)))
    if fused_moe_pairs is None:
        return
    results = {g: row(f"pairs {g}/{downs[0]}", routed(fused_moe_pairs, gate_up_config=g,
                                                      down_config=downs[0]))
               for g in gate_ups}
    best = min((g for g in results if results[g]), key=results.get)
    for d in downs[1:]:
        row(f"pairs {best}/{d}", routed(fused_moe_pairs, gate_up_config=best, down_config=d))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--quick", action="store_true", help="three configs a kernel")
    parser.add_argument("--whole-k", action="store_true",
                        help="down tiles over the whole intermediate size (module docstring)")
    args = parser.parse_args()
    torch.manual_seed(0)
    e, h, i = MOE_EXPERTS, MOE_HIDDEN, MOE_INTERMEDIATE
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * 0.02
    gate = torch.randn(h, e, device="cuda", dtype=torch.bfloat16)
    copy_tbs = measure_ceilings()["copy_TBps"]
    print(f"copy bandwidth {copy_tbs:.3f} TB/s", flush=True)
    configs = (QUICK if args.quick else WHOLE_K if args.whole_k
               else {"gate_up": GATE_UP_CONFIGS, "down": DOWN_CONFIGS})
    for m in map(int, args.rows.split(",")):
        probe(m, w13, w2, gate, copy_tbs, configs["gate_up"], configs["down"])


if __name__ == "__main__":
    main()
