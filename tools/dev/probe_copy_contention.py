"""Does the KV host tier's work on its side stream slow the decode kernels beside it?

    python tools/dev/probe_copy_contention.py [--layers 36] [--chunk-blocks 64]

Decoders slowed by 14% while loads were in flight (bench_kv_load_decode, Qwen3-8B), so the
probe times, on the GPU alone (no host in the loop), a decode-like batch of GEMMs (32 rows
through Qwen3-8B's gate_up weight shape, 24 of them, about 2.4 GB read) by itself and beside
each kind of work a transfer queues on a side stream: pinned host-to-device and device-to-host
copies of 128 MB, and the tier's scatter (index_copy_) and gather (index_select) of a chunk of
blocks between a Qwen3-8B-shaped stacked cache and a staging buffer, as KVTransfers does them,
and the direct mode's strided copies of a chunk (a cuMemcpy2DAsync per block, host to device).
Each is also timed alone, and the GEMMs are timed again behind a small pinned upload on their
stream that they read, as a step's kernels read its uploaded inputs: by the copy engine, and by
a kernel (ECHO_STEP_COPIES=kernel). A kind of work that slows the GEMMs by the 14% is the one to
make cheaper; if none does, the host is where the time goes.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from echo.worker.kv_cache import KVCacheSpec  # noqa: E402
from echo.worker.kv_transfer import direct_geometry  # noqa: E402
from echo.worker.strided_copy import StridedCopier  # noqa: E402
from echo_kernels.host_copy import copy_by_kernel  # noqa: E402


def event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def ms_per_call(fn, calls: int, stream: torch.cuda.Stream | None = None) -> float:
    """Per call, by events on `stream` (the current stream when None), where fn queues its
    work."""
    stream = stream or torch.cuda.current_stream()
    torch.cuda.synchronize()
    begin, end = event(), event()
    begin.record(stream)
    for _ in range(calls):
        fn()
    end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--cache-blocks", type=int, default=2048)
    parser.add_argument("--chunk-blocks", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda")
    spec = KVCacheSpec(num_layers=args.layers, block_size=16, num_kv_heads=8, head_dim=128,
                       model_dtype=torch.bfloat16, kv_cache_dtype="auto")
    plane = spec.allocate_stacked(args.cache_blocks, device).planes()[0].view(torch.int64)
    n = args.chunk_blocks
    staging = torch.empty(n, plane[0].numel(), dtype=torch.int64, device=device)
    index = torch.randperm(args.cache_blocks, device=device)[:n]
    host = torch.empty(2**27, dtype=torch.uint8, pin_memory=True)
    device_bytes = torch.empty(2**27, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream()
    # direct: each block's 2 * layers segments, a cache-wide pitch apart, from a host block,
    # by the geometry KVTransfers uses (block ids listed once: in the loop, .tolist() would wait)
    [(base, block_stride, pitch, width, height, _)] = direct_geometry([(plane, 0, 0)])
    blocks = index.tolist()
    host_blocks = torch.empty(n * width * height, dtype=torch.uint8, pin_memory=True)
    to_device = StridedCopier(to_device=True, stream=side)

    def direct_load():
        for i, block in enumerate(blocks):
            to_device.copy(base + block * block_stride, pitch,
                           host_blocks.data_ptr() + i * width * height, width, width, height)

    side_work = {
        "host-to-device 128 MB": lambda: device_bytes.copy_(host, non_blocking=True),
        "device-to-host 128 MB": lambda: host.copy_(device_bytes, non_blocking=True),
        f"scatter {n} blocks": lambda: plane.index_copy_(0, index,
                                                         staging.view(n, *plane.shape[1:])),
        f"gather {n} blocks": lambda: staging.copy_(plane.index_select(0, index).view(n, -1)),
        f"direct {n} blocks to device": direct_load,
    }
    side_ms = {}
    for name, work in side_work.items():
        with torch.cuda.stream(side):
            work()
            side_ms[name] = ms_per_call(work, 20, side)
        print(f"{name} alone: {side_ms[name]:.3f} ms")
    print(f"(a chunk is {staging.nbytes / 1e6:.0f} MB: the scatter and gather read and write "
          f"{2 * staging.nbytes / side_ms[f'scatter {n} blocks'] / 1e6:.0f} and "
          f"{2 * staging.nbytes / side_ms[f'gather {n} blocks'] / 1e6:.0f} GB/s)")

    weights = [torch.randn(4096, 12288, dtype=torch.bfloat16, device=device) for _ in range(24)]
    rows = torch.randn(32, 4096, dtype=torch.bfloat16, device=device)

    def gemms():
        for w in weights:
            torch.mm(rows, w)

    upload_host = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    upload_device = torch.empty_like(upload_host, device=device)

    def upload_then_gemms(by_kernel: bool):  # the GEMMs read the upload, as a step's kernels
        if by_kernel:  # read its inputs (worker/host_copies.py: ECHO_STEP_COPIES)
            copy_by_kernel(upload_device, upload_host)
        else:
            upload_device.copy_(upload_host, non_blocking=True)
        torch.mm(rows + upload_device[:1].to(rows.dtype), weights[0])
        gemms()

    for name, fn in (("GEMMs", gemms),
                     ("engine upload + GEMMs", lambda: upload_then_gemms(False)),
                     ("kernel upload + GEMMs", lambda: upload_then_gemms(True))):
        fn()
        alone = ms_per_call(fn, 30)
        print(f"{name} alone: {alone:.3f} ms")
        for side_name, work in side_work.items():
            with torch.cuda.stream(side):  # three times as long as the GEMMs' 30 calls
                for _ in range(int(3 * 30 * alone / side_ms[side_name]) + 1):
                    work()
            beside = ms_per_call(fn, 30)
            side.synchronize()
            print(f"{name} beside {side_name}: {beside:.3f} ms ({beside / alone - 1:+.1%})")
        print(f"{name} alone again: {ms_per_call(fn, 30):.3f} ms")


if __name__ == "__main__":
    main()
