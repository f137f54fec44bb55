"""The batch-1 decode attention launch alone (fused RoPE and K/V store, the keys split, the
merge), at preset shapes and contexts, over key-tile stage counts and warps: how long is the
launch a layer pays, and do fewer pipeline stages (a shorter prologue for a one-warp program,
see tools/dev/sass_chain.py) or a second warp (half the instructions each, an exchange through
shared memory a tile) pay at short contexts without losing at long ones?

    python tools/dev/probe_decode_attention.py [--models qwen3-0.6b,llama-3.1-8b]
        [--contexts 256,1024,4096] [--stages 4,3,2] [--warps 1,2] [--max-seqlen-k 2048]

CUDA graphs over copies of the cache beyond the L2 (tools/bench_kernels.bench_graph), the
split count the engine's graph gets for --max-seqlen-k keys (raised to the context where that
is longer). The first setting's output is the reference for the others.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import bench_graph, paged_decode_inputs  # noqa: E402
from sass_chain import preset_attention  # noqa: E402

from echo_kernels.attention.common import TileConfig, tile_config  # noqa: E402
from echo_kernels.attention.paged import NewKV, paged_attention  # noqa: E402

BLOCK_SIZE = 16
L2_BYTES = 128 << 20  # K/V copies in rotation: at least this much


def time_case(model: str, ctx: int, max_k: int, configs: list[TileConfig]) -> list[str]:
    heads, kv_heads, head_dim, norm = preset_attention(model)
    dtype = torch.bfloat16
    kv_bytes = ctx * kv_heads * head_dim * 2 * 2
    inputs = [paged_decode_inputs(1, ctx, (heads, kv_heads), head_dim, BLOCK_SIZE)
              for _ in range(max(1, -(-L2_BYTES // kv_bytes)))]
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(1, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn(1, kv_heads, head_dim, device="cuda", dtype=dtype)
    cos_sin = torch.randn(ctx, head_dim, device="cuda")
    weights = [torch.rand(head_dim, device="cuda", dtype=dtype) + 0.5 if norm else None
               for _ in range(2)]
    positions = torch.tensor([ctx - 1], device="cuda")
    cu_q = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)

    def call(inp, config):
        # the token's slot: the last key's place in this copy's blocks
        slot = inp["block_table"][0, (ctx - 1) // BLOCK_SIZE].long() * BLOCK_SIZE + (
            ctx - 1) % BLOCK_SIZE
        new_kv = NewKV(k, v, slot.view(1), positions, cos_sin, *weights, 1e-6, True)
        return lambda: paged_attention(q, inp["k_cache"], inp["v_cache"], inp["block_table"],
                                       cu_q, inp["seq_lens"], 1, max_k, head_dim ** -0.5,
                                       out=out, config=config, new_kv=new_kv)

    lines, first = [], None
    for config in configs:
        call(inputs[0], config)()
        result = out.float().clone()
        first = result if first is None else first
        error = ((result - first).abs().max() / first.abs().max()).item()
        us = bench_graph([call(inp, config) for inp in inputs]) * 1e3
        lines.append(f"{model} ctx {ctx} (graph bound {max_k}) stages {config.num_stages}, "
                     f"{config.num_warps} warps: "
                     f"{us:.2f} us a launch with its merge, error {error:.1e}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b,qwen3-30b-a3b")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--stages", default="4,3,2")
    parser.add_argument("--warps", default="1,2")
    parser.add_argument("--max-seqlen-k", type=int, default=2048)
    args = parser.parse_args()
    for model in args.models.split(","):
        head_dim = preset_attention(model)[2]
        default = tile_config(1, head_dim)
        configs = [TileConfig(default.block_m, default.block_n, int(w), int(s),
                              default.maxnreg, default.programs_per_sm)
                   for w in args.warps.split(",") for s in args.stages.split(",")]
        for ctx in map(int, args.contexts.split(",")):
            for line in time_case(model, ctx, max(ctx, args.max_seqlen_k), configs):
                print(line, flush=True)


if __name__ == "__main__":
    main()
