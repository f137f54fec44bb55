"""Where does a decode step stall while host-tier loads are in flight?

    python tools/dev/probe_kv_load_stall.py [--chunk-blocks N] [--chunks-in-flight N] \\
        [bench_kv_load_decode arguments]

Runs tools/bench_kv_load_decode.py with the worker's host-side waits timed: KVTransfers.start
(the host issuing a transfer's copies), ModelRunner.launch (a step's whole prepare and launch),
and the runner's wait for each step's sampled tokens (_land). Prints the longest of each with
the time since the first transfer started, so a stall can be told from a slow launch.
--chunk-blocks and --chunks-in-flight replace kv_transfer's STAGING_BLOCKS and
CHUNKS_IN_FLIGHT for the run.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_kv_load_decode  # noqa: E402

from echo.worker import kv_transfer, model_runner  # noqa: E402

records: dict[str, list[tuple[float, float]]] = {"start": [], "launch": [], "land": []}


def timed(cls, name: str, key: str) -> None:
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            records[key].append((began, time.perf_counter() - began))

    setattr(cls, name, wrapper)


timed(kv_transfer.KVTransfers, "start", "start")
timed(model_runner.ModelRunner, "launch", "launch")
timed(model_runner.ModelRunner, "_land", "land")

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk-blocks", type=int, default=kv_transfer.STAGING_BLOCKS)
    parser.add_argument("--chunks-in-flight", type=int, default=kv_transfer.CHUNKS_IN_FLIGHT)
    ours, rest = parser.parse_known_args()
    kv_transfer.KVTransfers.__init__.__defaults__ = (ours.chunk_blocks, ours.chunks_in_flight)
    print(f"chunks of {ours.chunk_blocks} blocks, {ours.chunks_in_flight} in flight")
    bench_kv_load_decode.main(rest)
    first = records["start"][0][0] if records["start"] else 0.0
    for key, values in records.items():
        top = sorted(values, key=lambda r: -r[1])[:6]
        print(f"{key}: {len(values)} calls, longest (ms at +ms): "
              + ", ".join(f"{1e3 * d:.1f} at {1e3 * (t - first):+.0f}" for t, d in top))
    # the calls after each large transfer started: does the land of the steps behind it wait?
    for t, d in [r for r in records["start"] if r[1] > 1e-3][:4]:
        lands = [f"{1e3 * w:.1f}" for s, w in records["land"] if t <= s < t + 0.5][:12]
        print(f"transfer at {1e3 * (t - first):+.0f} ms took {1e3 * d:.1f} ms to issue; "
              f"the next lands waited (ms): {' '.join(lands)}")
