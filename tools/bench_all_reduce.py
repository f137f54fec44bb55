"""Tensor-parallel all-reduce + residual add + RMSNorm, per call, on the GPUs of one host.

    python tools/bench_all_reduce.py [--world 2] [--hidden 4096] [--rows 1,8,64,256]
        [--calls 72] [--json F]

What a row-parallel layer's output costs before the next layer can start, three ways: NCCL's
all-reduce then echo's fused_add_rms_norm; torch's symmetric-memory one-shot all-reduce then the
same norm (ECHO_SYMM_MEM_ALL_REDUCE=1); echo's all_reduce_add_rms_norm in one launch (the
default). Each is captured `--calls` times in one CUDA graph (72: a Qwen3-8B decode step) and
replayed; the median µs per call is printed by rank 0. `norm alone` is the same norm without
any communication: what the all-reduce adds is the difference.
"""

import argparse
import json
import socket
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def graph_us_per_call(fn, calls: int, replays: int = 20) -> float:
    """Median µs per call of fn() captured `calls` times in one graph, ranks aligned first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, NCCL set-up) off the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def contenders(x, residual, weight, group, fused, symm, eps=1e-6) -> dict:
    from echo_kernels import fused_add_rms_norm

    def nccl():
        dist.all_reduce(x, group=group)
        fused_add_rms_norm(x, residual, weight, eps)

    ways = {"norm alone": lambda: fused_add_rms_norm(x, residual, weight, eps),
            "nccl + norm": nccl,
            "fused (echo)": lambda: fused(x, residual, weight, eps)}
    if symm.fits(x):
        ways["symm-mem one-shot + norm"] = \
            lambda: fused_add_rms_norm(symm(x), residual, weight, eps)
    return ways


def worker(rank: int, args, port: int, results) -> None:
    from echo.distributed.norm_all_reduce import NormAllReduce
    from echo.distributed.symm_mem_all_reduce import SymmMemAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}",
                            world_size=args.world, rank=rank, device_id=device)
    group = dist.group.WORLD
    dtype = torch.bfloat16
    fused = NormAllReduce(group, device, args.hidden, dtype)
    symm = SymmMemAllReduce(group, device, dtype=dtype)
    weight = torch.rand(args.hidden, dtype=dtype, device=device) + 0.5
    table = {}
    for rows in args.rows:
        # in place, as in the engine: values grow (or overflow) over the calls, which changes
        # no kernel's time
        x = torch.randn(rows, args.hidden, dtype=dtype, device=device)
        ways = contenders(x, torch.randn_like(x), weight, group, fused, symm)
        table[rows] = {name: graph_us_per_call(fn, args.calls) for name, fn in ways.items()}
    if rank == 0:
        results.update(table)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--rows", default="1,8,64,256",
                        type=lambda s: [int(v) for v in s.split(",")])
    parser.add_argument("--calls", type=int, default=72)
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    if torch.cuda.device_count() < args.world:
        parser.error(f"--world {args.world} needs that many GPUs, found "
                     f"{torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, port, results), nprocs=args.world, join=True)
        table = dict(results)
    names = list(next(iter(table.values())))
    print(f"µs per call, world {args.world}, hidden {args.hidden}, bf16, "
          f"{args.calls} calls per CUDA graph")
    print(f"{'rows':>6}  " + "  ".join(f"{n:>24}" for n in names))
    for rows, row in table.items():
        print(f"{rows:>6}  " + "  ".join(f"{row.get(n, float('nan')):>24.2f}" for n in names))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "hidden": args.hidden, "calls": args.calls,
                       "us_per_call": table}, f, indent=1)


if __name__ == "__main__":
    main()
