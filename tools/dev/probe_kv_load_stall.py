"""Where does a decode step stall while host-tier loads are in flight?

    python tools/dev/probe_kv_load_stall.py [--chunk-blocks N] [--chunks-in-flight N] \\
        [--copy-mode staged|split|direct] [bench_kv_load_decode arguments]

Runs tools/bench_kv_load_decode.py with the worker's host-side waits timed: KVTransfers.start
(the host issuing a transfer's copies), ModelRunner.launch (a step's whole prepare and launch),
and the runner's wait for each step's sampled tokens (_land). Prints the longest of each with
the time since the first transfer started, so a stall can be told from a slow launch, then
both split by the step's content: steps that compute prompt or history tokens (the resumed
histories' first steps), decode-only steps while host-tier loads are pending, while only
stores are (the fillers' write-through), and decode-only steps without any transfer, each a
count with median and longest launch and land. Last, the copy engine's use over the large
loads on the device's clock: the time copies ran and the idle gaps between chunks, inside a
transfer or between two (the loads' rate over their wall time counts at the steps' grain).
--chunk-blocks, --chunks-in-flight and --copy-mode replace kv_transfer's STAGING_BLOCKS,
CHUNKS_IN_FLIGHT and ECHO_KV_COPY_MODE for the run.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_kv_load_decode  # noqa: E402

from echo import envs  # noqa: E402
from echo.worker import kv_transfer, model_runner  # noqa: E402

records: dict[str, list[tuple[float, float]]] = {"start": [], "launch": [], "land": []}
# step id -> [content, launch seconds, land seconds]
steps: dict[int, list] = {}


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


def step_content(runner, out) -> str:
    """What a launched step computes: prompt or history tokens, or decodes with host-tier
    loads pending (started by it or before), with only stores pending, or plain decodes."""
    if any(n > 1 for n in out.num_scheduled_tokens.values()):
        return "prefill"
    transfers = runner.kv_transfers
    pending = [t for t in transfers._pending.values() if not t.reported] if transfers else []
    if any(t.loads for t in out.kv_transfers) or any(t.loaded_bytes for t in pending):
        return "decode, loads pending"
    if out.kv_transfers or pending:
        return "decode, stores pending"
    return "decode"


def by_step() -> None:
    """Record each step's content, launch and land time (joined by step id)."""
    launch, land = model_runner.ModelRunner.launch, model_runner.ModelRunner._land

    def launch_wrapper(self, out):
        content = step_content(self, out)
        began = time.perf_counter()
        try:
            return launch(self, out)
        finally:
            steps[out.step_id] = [content, time.perf_counter() - began, None]

    def land_wrapper(self, step):
        began = time.perf_counter()
        try:
            return land(self, step)
        finally:
            if step.step_id in steps:
                steps[step.step_id][2] = time.perf_counter() - began

    model_runner.ModelRunner.launch = launch_wrapper
    model_runner.ModelRunner._land = land_wrapper


# every chunk a KVTransfers issued: (its transfer, store?, blocks, begin event, end-of-copy
# event)
chunks: list[tuple[int, bool, int, object, object]] = []


def chunk_timeline() -> None:
    """Record each chunk's copy events as it is issued (poll_done drops them once summed)."""
    issue = kv_transfer.KVTransfers._issue_chunk

    def wrapper(self, transfer, store, first, end, host_ids):
        done = issue(self, transfer, store, first, end, host_ids)
        begin, copied = transfer.timings[-1]
        chunks.append((id(transfer), store, end - first, begin, copied))
        return done

    kv_transfer.KVTransfers._issue_chunk = wrapper


def print_load_timeline(min_blocks: int = 1024) -> None:
    """The copy engine's use over the large loads (those of at least min_blocks: the
    histories, not the fillers' stores), on the device's clock: the span from their first
    chunk's copy to their last, the time some copy ran, and the idle gaps between chunks,
    inside a transfer (the host issuing, a staged scatter) or between two."""
    loads = [c for c in chunks if not c[1]]
    sizes: dict[int, int] = {}
    for transfer, _, blocks, *_ in loads:
        sizes[transfer] = sizes.get(transfer, 0) + blocks
    loads = [c for c in loads if sizes[c[0]] >= min_blocks]
    if not loads:
        print("load timeline: no large loads")
        return
    origin = loads[0][3]
    spans = sorted((origin.elapsed_time(b), origin.elapsed_time(e), t)
                   for t, _, _, b, e in loads)
    busy, gaps, end, last = 0.0, [], spans[0][0], spans[0][2]
    for begin, finish, transfer in spans:
        if begin > end:
            gaps.append((begin - end, begin, transfer == last))
        busy += max(0.0, finish - max(begin, end))
        end, last = max(end, finish), transfer
    inside = sum(g for g, _, same in gaps if same)
    between = sum(g for g, _, same in gaps if not same)
    print(f"load timeline: {len({c[0] for c in loads})} transfers, {len(loads)} chunks over "
          f"{end:.1f} ms of device time, copies running {busy:.1f} ms "
          f"({100 * busy / end:.0f}%); idle {inside:.1f} ms between chunks of one transfer, "
          f"{between:.1f} ms between transfers")
    top = sorted(gaps, reverse=True)[:8]
    print("  longest gaps (ms at +ms, same transfer?): "
          + ", ".join(f"{g:.2f} at {at:+.0f} {'same' if same else 'next'}"
                      for g, at, same in top))


def print_by_content() -> None:
    kinds: dict[str, list] = {}
    for content, launch_s, land_s in steps.values():
        kinds.setdefault(content, []).append((launch_s, land_s))
    for content, rows in sorted(kinds.items()):
        launches = [1e3 * a for a, _ in rows]
        lands = [1e3 * b for _, b in rows if b is not None]
        print(f"{content}: {len(rows)} steps; launch median {statistics.median(launches):.2f} "
              f"max {max(launches):.1f} ms; land median "
              f"{statistics.median(lands) if lands else float('nan'):.2f} "
              f"max {max(lands, default=float('nan')):.1f} ms")


by_step()
chunk_timeline()

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunk-blocks", type=int, default=kv_transfer.STAGING_BLOCKS)
    parser.add_argument("--chunks-in-flight", type=int, default=kv_transfer.CHUNKS_IN_FLIGHT)
    parser.add_argument("--copy-mode", choices=kv_transfer.COPY_MODES, default=None,
                        help="default: ECHO_KV_COPY_MODE's")
    ours, rest = parser.parse_known_args()
    if ours.copy_mode is None:
        ours.copy_mode = envs.kv_copy_mode()
    kv_transfer.KVTransfers.__init__.__defaults__ = (ours.chunk_blocks, ours.chunks_in_flight,
                                                     ours.copy_mode)
    print(f"chunks of {ours.chunk_blocks} blocks, {ours.chunks_in_flight} in flight, copy "
          f"mode {ours.copy_mode}")
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
    print_by_content()
    print_load_timeline()
