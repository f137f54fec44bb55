"""Where does a decode step's time go while host-tier loads are in flight? A kernel trace.

    python tools/dev/probe_kv_load_trace.py --out DIR [--steps N] [--skip N] [--high-priority] \\
        [bench_kv_load_decode arguments]

Runs tools/bench_kv_load_decode.py (CUDA, the engine in this process) with the PyTorch profiler
on over two windows of --steps engine steps in which the decoders alone decode: one before the
histories come back ("alone"), one while their loads are in flight ("loading"). Each window's
trace goes to DIR/WINDOW.json.gz, and a summary is printed per window: per step, each stream's
kernel time and the main stream's idle time between kernels, copies by direction, the host's
longest CUDA calls (a synchronize or a pinned allocation waits for the device), and the
kernels whose total time changed the most between the windows. The question it answers: is a
step slower because its own kernels run slower (contention), because the main stream waits
(gaps), or because of kernels that are not the step's.
"""

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_kv_load_decode  # noqa: E402


class Windows:
    """Wraps the scheduler's update_from_output: turns the profiler on and off around the two
    windows, counting steps in which the decoders alone decode."""

    def __init__(self, scheduler, num_decoders: int, steps: int, skip: int, out: Path):
        import torch

        self.torch, self.out, self.steps, self.skip = torch, out, steps, skip
        self.alone_seen = self.loading_seen = 0
        self.profiler, self.window, self.left = None, None, 0
        self.done: list[str] = []
        update = scheduler.update_from_output

        def wrapped(scheduler_output, runner_output):
            result = update(scheduler_output, runner_output)
            alone = (len(scheduler_output.num_scheduled_tokens)
                     == scheduler_output.total_num_scheduled_tokens == num_decoders)
            self.on_step(alone, scheduler.kv.loads_in_flight)
            return result

        scheduler.update_from_output = wrapped

    def on_step(self, alone: bool, loading: bool) -> None:
        if self.profiler is not None:
            self.left -= 1
            if self.left == 0:
                if self.torch.cuda.is_available():
                    self.torch.cuda.synchronize()
                self.profiler.stop()
                path = self.out / f"{self.window}.json"
                self.profiler.export_chrome_trace(str(path))
                with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
                    g.write(f.read())
                path.unlink()
                self.done.append(self.window)
                self.profiler = None
            return
        if not alone:
            return
        if loading:
            self.loading_seen += 1
        else:
            self.alone_seen += 1
        for window, seen in (("alone", self.alone_seen), ("loading", self.loading_seen)):
            if seen == self.skip + 1 and window not in self.done:  # past each phase's first steps
                from torch.profiler import ProfilerActivity, profile

                self.profiler = profile(activities=[ProfilerActivity.CPU,
                                                    ProfilerActivity.CUDA])
                self.profiler.start()
                self.window, self.left = window, self.steps
                return


def summarize(path: Path, steps: int) -> dict:
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:  # a CPU run
        return {}
    copies = [e for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    by_stream: dict[int, list] = defaultdict(list)
    for e in kernels:
        by_stream[e["args"].get("stream", -1)].append(e)
    main = max(by_stream, key=lambda s: len(by_stream[s]))
    ordered = sorted(by_stream[main], key=lambda e: e["ts"])
    span = ordered[-1]["ts"] + ordered[-1]["dur"] - ordered[0]["ts"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(ordered, ordered[1:])]
    per_kernel: dict[str, float] = defaultdict(float)
    for e in ordered:
        per_kernel[e["name"][:90]] += e["dur"] / steps
    copy_us: dict[str, float] = defaultdict(float)
    for e in copies:
        copy_us[e["name"]] += e["dur"] / steps
    # the host's CUDA calls: a synchronize, an event wait or a pinned allocation (which waits
    # for the whole device) shows here as the time the host spent in it
    runtime_us: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            runtime_us[e["name"]] += e["dur"] / steps
    return {
        "main_stream": main,
        "main_span_us_per_step": span / steps,
        "main_kernel_us_per_step": sum(e["dur"] for e in ordered) / steps,
        "main_gap_us_per_step": sum(g for g in gaps if g > 0) / steps,
        "main_gaps_over_50us": sorted((round(g) for g in gaps if g > 50), reverse=True)[:20],
        "main_kernels_per_step": len(ordered) / steps,
        "other_streams_us_per_step": {s: sum(e["dur"] for e in v) / steps
                                      for s, v in by_stream.items() if s != main},
        "other_stream_kernels": sorted({e["name"][:60] for s, v in by_stream.items()
                                        if s != main for e in v}),
        "copies_us_per_step": dict(copy_us),
        "host_cuda_calls_us_per_step": dict(sorted(runtime_us.items(), key=lambda r: -r[1])[:8]),
        "per_kernel": dict(per_kernel),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=3,
                        help="steps of each phase before its window")
    parser.add_argument("--high-priority", action="store_true",
                        help="run the engine (in this thread) on a stream of the highest "
                             "priority: the tier's side stream keeps the default, the lowest")
    ours, rest = parser.parse_known_args()
    ours.out.mkdir(parents=True, exist_ok=True)
    clock_init = bench_kv_load_decode.StepClock.__init__
    num_decoders = bench_kv_load_decode.arguments().parse_args(rest).decoders
    windows: list[Windows] = []

    def clock_with_windows(self, scheduler):
        clock_init(self, scheduler)
        windows.append(Windows(scheduler, num_decoders, ours.steps, ours.skip, ours.out))

    bench_kv_load_decode.StepClock.__init__ = clock_with_windows
    if ours.high_priority:
        import torch

        # out-of-range priorities map to the nearest valid one: the highest
        torch.cuda.set_stream(torch.cuda.Stream(priority=-100))
        print(f"engine stream priority {torch.cuda.current_stream().priority}")
    bench_kv_load_decode.main(rest)
    summaries = {}
    for window in ("alone", "loading"):
        path = ours.out / f"{window}.json.gz"
        if path.exists():
            summaries[window] = summarize(path, ours.steps)
    for window, s in summaries.items():
        if not s:
            print(f"== {window}: no kernels traced")
            continue
        print(f"== {window}: main stream {s['main_stream']}: span {s['main_span_us_per_step']:.0f}"
              f" us a step, kernels {s['main_kernel_us_per_step']:.0f}, gaps "
              f"{s['main_gap_us_per_step']:.0f} ({s['main_kernels_per_step']:.0f} kernels); "
              f"gaps > 50 us: {s['main_gaps_over_50us']}")
        print(f"   other streams (us a step): {s['other_streams_us_per_step']}; "
              f"{s['other_stream_kernels']}")
        print(f"   copies (us a step): {s['copies_us_per_step']}")
        print(f"   host CUDA calls (us a step): {s['host_cuda_calls_us_per_step']}")
    if len(summaries) == 2 and all(summaries.values()):
        a, b = summaries["alone"]["per_kernel"], summaries["loading"]["per_kernel"]
        diffs = sorted(((b.get(k, 0) - a.get(k, 0), k) for k in set(a) | set(b)),
                       key=lambda d: -abs(d[0]))
        print("kernels whose time a step changed most (loading - alone, us):")
        for d, k in diffs[:12]:
            print(f"   {d:+8.1f}  alone {a.get(k, 0):8.1f}  {k}")
    (ours.out / "summary.json").write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
