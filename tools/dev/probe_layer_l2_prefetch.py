"""Does streaming the next layer's weights into the L2 beside the current layer pay at batch 1?

    python tools/dev/probe_layer_l2_prefetch.py [--spin-us 8] [--fractions 0,0.25,0.5,1]

#27's question after the persistent decode step lost to the launch chain (docs/benchmarks.md,
Decode latency at batch 1). Qwen3-0.6B's GEMVs run at 1-2 TB/s because each is too short to
reach the memory's bandwidth (4-12 MB, ~4 µs each), while HBM idles through attention, the
norms and every launch's ramp and tail: a layer's 31.5 MB take ~7.5 µs at 4.2 TB/s of a ~30 µs
layer. A layer's weights fit the H200's 50 MB L2 (the earlier L2 prefetches were for Qwen3-8B,
whose layers do not: docs/benchmarks.md, What was tried and dropped). So here, per layer, a
second stream forked inside the CUDA graph runs one short kernel that issues
`cp.async.bulk.prefetch.L2` over the first fraction of each of the next layer's four weights
(fire and forget), while the main stream runs the layer as a chain: the qkv GEMV, a
one-program spin of --spin-us standing for attention and the norms, o_proj, gate_up, down
(small_m_linear with PDL, as the engine's tuned layers; each reads the one before's output).
28 layers of random bf16 weights (881 MB), so no layer is left in the L2 from the replay
before. Prints µs per chain for each fraction (0: no prefetch, the engine today) after
checking the chain's output against PyTorch's.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools"), str(ROOT / "tools" / "dev")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from bench_kernels import bench_graph  # noqa: E402
from bench_l2_prefetch import _prefetch_bulk, short_kernel  # noqa: E402

from echo_kernels.linear import small_m_linear  # noqa: E402

# Qwen3-0.6B's four GEMVs (N, K) in layer order; each reads the first K outputs of the one before
SHAPES = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
CHUNK = 16384  # bytes a bulk prefetch: a thread's share
PREFETCH_BLOCK = 128  # chunks a program


@triton.jit
def _prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """The L2 fetches nbytes from base_ptr, a CHUNK a thread; the kernel ends at once."""
    chunk = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offset = chunk * CHUNK
    size = tl.minimum(nbytes - offset, CHUNK).to(tl.int32)
    _prefetch_bulk(base_ptr.to(tl.pointer_type(tl.int8)) + offset, (size + 15) // 16 * 16,
                   offset < nbytes)


def prefetch(weight: torch.Tensor, fraction: float) -> None:
    nbytes = int(weight.numel() * weight.element_size() * fraction) // 16 * 16
    if nbytes:
        _prefetch_kernel[(triton.cdiv(nbytes, CHUNK * PREFETCH_BLOCK),)](
            weight, nbytes, CHUNK=CHUNK, BLOCK=PREFETCH_BLOCK, num_warps=4)


def chain(x: torch.Tensor, layers: list[list[torch.Tensor]], spin_us: float, fraction: float,
          side: torch.cuda.Stream | None) -> torch.Tensor:
    """The layers' GEMVs on the current stream; with a side stream, each layer first forks a
    prefetch of the next layer's weights onto it (joined at the end)."""
    main = torch.cuda.current_stream()
    for i, weights in enumerate(layers):
        if side is not None and i + 1 < len(layers):
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for w in layers[i + 1]:
                    prefetch(w, fraction)
        qkv, o_proj, gate_up, down = weights
        h = small_m_linear(x, qkv)[:, :o_proj.shape[1]]
        if spin_us:
            short_kernel(qkv, 0, spin_us, 0)  # a program spinning: no bandwidth
        h = small_m_linear(h, o_proj)
        h = small_m_linear(h, gate_up)[:, :down.shape[1]]
        x = small_m_linear(h, down)
    if side is not None:
        main.wait_stream(side)
    return x


def reference(x: torch.Tensor, layers: list[list[torch.Tensor]]) -> torch.Tensor:
    for qkv, o_proj, gate_up, down in layers:
        h = F.linear(x.float(), qkv.float())[:, :o_proj.shape[1]].to(x.dtype)
        h = F.linear(h.float(), o_proj.float()).to(x.dtype)
        h = F.linear(h.float(), gate_up.float())[:, :down.shape[1]].to(x.dtype)
        x = F.linear(h.float(), down.float()).to(x.dtype)
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--spin-us", type=float, default=8.0)
    parser.add_argument("--fractions", default="0,0.25,0.5,1",
                        type=lambda s: [float(v) for v in s.split(",")])
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
               for n, k in SHAPES] for _ in range(args.layers)]
    x = torch.randn(1, SHAPES[0][1], device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    expected = reference(x, layers).float()
    got = chain(x, layers, args.spin_us, 1.0, side).float()
    torch.cuda.synchronize()
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    megabytes = sum(w.numel() * 2 for w in layers[0]) / 1e6
    print(f"{args.layers} layers of {megabytes:.1f} MB, spin {args.spin_us:g} us a layer; "
          f"the chain's output within {error:.1e} of PyTorch's largest")
    for fraction in args.fractions:
        us = 1e3 * bench_graph([lambda f=fraction: chain(x, layers, args.spin_us, f,
                                                         side if f else None)], inner=2)
        print(f"next layer's weights prefetched: {fraction:4.2f}  {us:8.1f} us a chain, "
              f"{us / args.layers:6.2f} a layer", flush=True)


if __name__ == "__main__":
    main()
