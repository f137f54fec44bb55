"""Where the GPU waits for the host: the device's idle time before each kernel, summed by the
echo range its launch came from (a PyTorch or nsys trace recorded with ECHO_NVTX=1, e.g. by
tools/nsys_profile.sh). With structured outputs, idle before kernels launched in "bitmask" is
the mask arriving after the forward finished; idle before "forward" kernels is the next step
launched after the sampling finished.

    python tools/dev/idle_by_launch.py TRACE [--steps-with bitmask]
"""

import argparse
import bisect
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trace_formats import Range, load_trace  # noqa: E402


def launch_ranges(trace) -> list[Range | None]:
    """The innermost stepped echo range around each kernel's launch call (None if none)."""
    by_thread: dict = defaultdict(list)
    for r in trace.ranges:
        if r.step is not None:
            by_thread[r.thread].append(r)
    for ranges in by_thread.values():
        ranges.sort(key=lambda r: r.start)
    starts = {t: [r.start for r in rs] for t, rs in by_thread.items()}
    found = []
    for k in trace.kernels:
        launch = trace.launches.get(k.corr) if k.corr is not None else None
        hit = None
        if launch is not None and launch[0] in by_thread:
            thread, ts = launch
            i = bisect.bisect_right(starts[thread], ts) - 1
            for r in by_thread[thread][max(0, i - 8): i + 1][::-1]:
                if r.start <= ts <= r.end:
                    hit = r
                    break
        found.append(hit)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--steps-with", default=None, metavar="RANGE")
    args = parser.parse_args()
    trace = load_trace(args.trace)
    kernels = sorted(zip(trace.kernels, launch_ranges(trace)), key=lambda kr: kr[0].start)
    kernels = [(k, r) for k, r in kernels if r is not None]
    marked = ({r.step for r in trace.ranges if r.name == args.steps_with}
              if args.steps_with else None)
    idle: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    steps = set()
    busy_until = None
    for kernel, rng in kernels:
        if busy_until is not None and (marked is None or rng.step in marked):
            gap = max(0.0, kernel.start - busy_until)
            if gap > 0:
                idle[rng.name] += gap
                count[rng.name] += 1
            steps.add(rng.step)
        busy_until = kernel.end if busy_until is None else max(busy_until, kernel.end)
    n = max(len(steps), 1)
    print(f"{n} steps; GPU idle before kernels launched in (us per step, gaps):")
    for name, total in sorted(idle.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<20} {total / n / 1e3:9.1f}  {count[name]}")


if __name__ == "__main__":
    main()
