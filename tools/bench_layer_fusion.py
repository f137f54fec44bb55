"""What folding the decoder layer's norms and SwiGLU into its GEMVs saves at batch 1.

    python tools/bench_layer_fusion.py [--layers 36] [--json F]

A decode step at batch 1 streams each layer's weights through four linear layers, with short
launches in between. This times, per layer, the linear part of a Qwen3-8B decoder layer
(attention left out: o_proj reads the first 4096 qkv outputs) over 36 layers' own weights in
one CUDA graph, as the engine replays it:

- separate: add + RMSNorm, qkv GEMV, o_proj GEMV, add + RMSNorm, cuBLAS gate/up, SwiGLU, down
  GEMV (the tiles the start-up tuning picks on an H200);
- fused: the residual adds in the o_proj and down GEMVs' epilogues, the norms' 1/rms in the
  qkv GEMV and in SwiGLU (their weights folded into qkv and gate/up), cuBLAS gate/up;
- fused + gated: the same with a gated GEMV (silu(gate) * up, 1/rms included) for gate/up.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo_kernels import fused_add_rms_norm, silu_and_mul  # noqa: E402
from echo_kernels.linear import small_m_linear  # noqa: E402

HIDDEN, QKV, INTER = 4096, 6144, 12288  # Qwen3-8B
EPS = 1e-6
QKV_TILE = dict(block_n=4, block_k=512, num_warps=2)
O_TILE = dict(block_n=4, block_k=512, num_warps=2, prefetch=True)
DOWN_TILE = dict(block_n=4, block_k=512, num_warps=4, prefetch=True)
GATED_TILES = [dict(block_n=4, block_k=512, num_warps=4), dict(block_n=8, block_k=512, num_warps=4),
               dict(block_n=4, block_k=512, num_warps=2), dict(block_n=4, block_k=512,
                                                               num_warps=2, prefetch=True),
               dict(block_n=16, block_k=256, num_warps=4), dict(block_n=2, block_k=1024,
                                                                num_warps=4)]


def layer_weights(n: int):
    def w(rows, cols):
        return torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16) / cols**0.5

    return [dict(qkv=w(QKV, HIDDEN), o=w(HIDDEN, HIDDEN), gate_up=w(2 * INTER, HIDDEN),
                 down=w(HIDDEN, INTER), g1=torch.ones(HIDDEN, device="cuda",
                                                      dtype=torch.bfloat16),
                 g2=torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)) for _ in range(n)]


def separate(layers, h, res):
    for L in layers:
        x, res = fused_add_rms_norm(h, res, L["g1"], EPS)
        qkv = small_m_linear(x, L["qkv"], **QKV_TILE)
        o = small_m_linear(qkv[:, :HIDDEN], L["o"], **O_TILE)
        x, res = fused_add_rms_norm(o, res, L["g2"], EPS)
        h = small_m_linear(silu_and_mul(F.linear(x, L["gate_up"])), L["down"], **DOWN_TILE)
    return h, res


def fused(layers, h, res, gated_tile=None):
    s = h  # the residual stream
    for L in layers:
        qkv = small_m_linear(s, L["qkv"], **QKV_TILE, rms_eps=EPS)
        s = small_m_linear(qkv[:, :HIDDEN], L["o"], **O_TILE, residual=s)
        if gated_tile is None:
            act = silu_and_mul(F.linear(s, L["gate_up"]), rms_of=s, eps=EPS)
        else:
            act = small_m_linear(s, L["gate_up"], **gated_tile, gated=True, rms_eps=EPS)
        s = small_m_linear(act, L["down"], **DOWN_TILE, residual=s)
    return s, s


def time_graph(fn, replays: int = 20) -> float:
    """Median ms per replay of fn captured in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--json")
    args = parser.parse_args()
    layers = layer_weights(args.layers)
    h = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    results = {}
    for rnd in range(2):  # twice, interleaved: the spread between rounds is the noise
        runs = {"separate": lambda: separate(layers, h.clone(), res.clone()),
                "fused": lambda: fused(layers, h.clone(), res.clone())}
        for tile in GATED_TILES:
            name = "fused + gated {block_n}x{block_k} {num_warps}w".format(**tile) + \
                (" prefetch" if tile.get("prefetch") else "")
            runs[name] = lambda tile=tile: fused(layers, h.clone(), res.clone(), tile)
        for name, fn in runs.items():
            us = time_graph(fn) * 1e3 / args.layers
            results.setdefault(name, []).append(round(us, 2))
            print(f"round {rnd}: {name}: {us:.2f} us per layer", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
