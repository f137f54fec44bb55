"""How much of the engine's CPU work hides behind GPU work, from an nsys or PyTorch trace.

    python tools/overlap_report.py TRACE [--out DIR] [--device N] [--timeline-steps 4]
        [--steps-with RANGE | --steps-without RANGE]

TRACE: an nsys SQLite export or a PyTorch-profiler Chrome trace (.json / .json.gz), recorded
with ECHO_NVTX=1 (tools/nsys_profile.sh does all of it). Prints a table; writes DIR/overlap.json,
DIR/timeline.png and DIR/gaps.png (DIR: the trace's folder by default).

Definitions (one GPU, --device, default the lowest id with kernels):
- a kernel belongs to the step whose echo range (same thread) contains its launch call;
- window: from the first kernel of the first such step to the last kernel of the last one;
- busy fraction: time inside the window when at least one kernel runs, over the window
  (copies and memsets alone do not count: the SMs are idle then);
- gap between consecutive steps A < B: idle time between A's last kernel end and B's first
  kernel start (0 when they touch or overlap);
- CPU ranges: every echo range of a step in the window (ranges without a step: those that
  overlap the window, clipped to it); overlapped fraction: the part of them during which a
  kernel ran, over their total time.
"""

import argparse
import bisect
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_formats import Kernel, Range, Trace, kernel_steps, load_trace  # noqa: E402

TOP_KERNELS = 15
# table order of the phases echo marks; anything else follows alphabetically
PHASE_ORDER = ("schedule", "prepare", "forward", "sample", "output", "update",
               "output-processing")


class Intervals:
    """A union of intervals, asked how much of [a, b] it covers."""

    def __init__(self, spans: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        self.starts = [m[0] for m in merged]
        self.ends = [m[1] for m in merged]
        self.cum = [0.0]  # cum[i]: total length of the first i intervals
        for start, end in merged:
            self.cum.append(self.cum[-1] + end - start)

    def covered(self, a: float, b: float) -> float:
        if b <= a:
            return 0.0
        i = bisect.bisect_right(self.ends, a)  # first interval ending after a
        j = bisect.bisect_left(self.starts, b)  # intervals [i, j) start before b
        if i >= j:
            return 0.0
        total = self.cum[j] - self.cum[i]
        total -= max(0.0, a - self.starts[i])
        total -= max(0.0, self.ends[j - 1] - b)
        return total


def _phase_key(name: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER), name)


def steps_marked(trace: Trace, name: str) -> set[int]:
    """The steps with a range called name (e.g. "bitmask": the steps with constrained rows)."""
    return {r.step for r in trace.ranges if r.name == name and r.step is not None}


def compute_metrics(trace: Trace, device: int | None = None, top: int = TOP_KERNELS,
                    only_steps: set[int] | None = None) -> dict:
    """only_steps: count those steps alone (the window then runs from the first to the last
    of them; gaps only between two of them that follow each other)."""
    devices = sorted({k.device for k in trace.kernels})
    if not devices:
        return cpu_only_metrics(trace)
    device = devices[0] if device is None else device
    kernels = sorted((k for k in trace.kernels if k.device == device), key=lambda k: k.start)
    if not kernels:
        raise ValueError(f"no kernels on device {device}; devices with kernels: {devices}")
    steps_of = kernel_steps(trace, kernels)
    span: dict[int, list[float]] = {}  # step -> [first kernel start, last kernel end]
    for k, step in zip(kernels, steps_of):
        if step is not None:
            s = span.setdefault(step, [k.start, k.end])
            s[0], s[1] = min(s[0], k.start), max(s[1], k.end)
    steps = sorted(span)
    if only_steps is not None:
        following = {a: b for a, b in zip(steps, steps[1:])}
        steps = [s for s in steps if s in only_steps]
        pairs = [(a, following[a]) for a in steps if following.get(a) in only_steps]
    else:
        pairs = list(zip(steps, steps[1:]))
    if steps:
        t0, t1 = span[steps[0]][0], span[steps[-1]][1]
    else:  # no launch could be tied to a step: the whole kernel span
        t0, t1 = kernels[0].start, max(k.end for k in kernels)
    window = t1 - t0
    busy = Intervals([(k.start, k.end) for k in kernels])
    busy_ns = busy.covered(t0, t1)

    gaps = [busy_idle(busy, span[a][1], span[b][0]) for a, b in pairs]
    periods = [span[b][0] - span[a][0] for a, b in pairs]

    return {
        "source": trace.source,
        "device": device,
        "window_ms": window / 1e6,
        "gpu_busy_fraction": busy_ns / window if window > 0 else 0.0,
        "gpu_busy_ms": busy_ns / 1e6,
        "steps": {"count": len(steps), "first": steps[0] if steps else None,
                  "last": steps[-1] if steps else None,
                  "gpu_period_mean_us": float(np.mean(periods)) / 1e3 if periods else None},
        "unattributed_kernels": sum(
            1 for k, s in zip(kernels, steps_of) if s is None and t0 <= k.start < t1),
        "gaps": gap_stats(gaps, window, periods),
        "cpu_ranges": range_stats(trace.ranges, set(steps), t0, t1, busy),
        "kernels_top": kernel_table([k for k in kernels if t0 <= k.start < t1], top),
    }


def cpu_only_metrics(trace: Trace) -> dict:
    """A trace without kernels (a CPU run, say): the CPU ranges alone, nothing overlapped."""
    if not trace.ranges:
        raise ValueError("the trace holds neither GPU kernels nor echo ranges (was ECHO_NVTX=1 "
                         "set, and did the run reach the profiled steps?)")
    t0 = min(r.start for r in trace.ranges)
    t1 = max(r.end for r in trace.ranges)
    steps = {r.step for r in trace.ranges if r.step is not None}
    return {
        "source": trace.source, "device": None, "window_ms": (t1 - t0) / 1e6,
        "gpu_busy_fraction": 0.0, "gpu_busy_ms": 0.0,
        "steps": {"count": len(steps), "first": min(steps, default=None),
                  "last": max(steps, default=None), "gpu_period_mean_us": None},
        "unattributed_kernels": 0, "gaps": gap_stats([], t1 - t0, []),
        "cpu_ranges": range_stats(trace.ranges, steps, t0, t1, Intervals([])),
        "kernels_top": [],
    }


def busy_idle(busy: Intervals, a: float, b: float) -> float:
    return (b - a) - busy.covered(a, b) if b > a else 0.0


def gap_stats(gaps: list[float], window: float, periods: list[float]) -> dict:
    us = np.asarray(gaps, dtype=float) / 1e3
    if not len(us):
        return {"count": 0, "values_us": []}
    total = float(us.sum())
    return {
        "count": len(us),
        "nonzero": int((us > 0).sum()),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "max_us": float(us.max()),
        "total_us": total,
        "fraction_of_window": total * 1e3 / window if window > 0 else 0.0,
        # the design's target: idle between steps under a few percent of the step time
        "fraction_of_step": total * 1e3 / sum(periods) if sum(periods) > 0 else 0.0,
        "values_us": us.tolist(),
    }


def range_stats(ranges: list[Range], steps: set[int], t0: float, t1: float,
                busy: Intervals) -> dict:
    groups: dict[str, list[tuple[float, float, int | None]]] = defaultdict(list)
    for r in ranges:
        if r.step is not None:
            if r.step in steps:
                groups[r.name].append((r.start, r.end, r.step))
        elif r.end > t0 and r.start < t1:
            groups[r.name].append((max(r.start, t0), min(r.end, t1), None))
    out = {}
    for name in sorted(groups, key=_phase_key):
        items = groups[name]
        total = sum(e - s for s, e, _ in items)
        hidden = sum(busy.covered(s, e) for s, e, _ in items)
        stepped = {step for _, _, step in items if step is not None}
        per = len(stepped) if stepped else len(items)
        out[name] = {
            "count": len(items),
            "total_us": total / 1e3,
            "per_step_us": total / 1e3 / per,
            "overlapped_fraction": hidden / total if total > 0 else 0.0,
        }
    return out


def kernel_table(kernels: list[Kernel], top: int) -> list[dict]:
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for k in kernels:
        total[k.name] += k.end - k.start
        count[k.name] += 1
    grand = sum(total.values()) or 1.0
    rows = sorted(total, key=lambda n: -total[n])[:top]
    return [{"name": n, "count": count[n], "total_us": total[n] / 1e3,
             "mean_us": total[n] / 1e3 / count[n], "fraction": total[n] / grand} for n in rows]


def format_report(m: dict) -> str:
    lines = [f"trace: {m['source']}, device {m['device']}, window {m['window_ms']:.2f} ms, "
             f"{m['steps']['count']} steps ({m['steps']['first']}..{m['steps']['last']})",
             f"GPU busy: {100 * m['gpu_busy_fraction']:.1f}% ({m['gpu_busy_ms']:.2f} ms)"]
    if m["steps"]["gpu_period_mean_us"] is not None:
        lines.append(f"GPU step period: {m['steps']['gpu_period_mean_us']:.1f} us mean")
    g = m["gaps"]
    if g["count"]:
        lines.append(f"idle gaps between steps: {g['count']} ({g['nonzero']} nonzero), "
                     f"p50 {g['p50_us']:.1f} us, p99 {g['p99_us']:.1f} us, "
                     f"total {g['total_us']:.1f} us = {100 * g['fraction_of_step']:.1f}% "
                     f"of step time")
    lines += ["", f"{'CPU range':<20}{'count':>7}{'per step us':>13}{'total us':>12}"
                  f"{'hidden':>9}"]
    for name, r in m["cpu_ranges"].items():
        lines.append(f"{name:<20}{r['count']:>7}{r['per_step_us']:>13.1f}{r['total_us']:>12.1f}"
                     f"{100 * r['overlapped_fraction']:>8.1f}%")
    lines += ["", f"{'kernel':<70}{'count':>7}{'total us':>12}{'share':>8}"]
    for k in m["kernels_top"]:
        name = k["name"] if len(k["name"]) <= 68 else k["name"][:65] + "..."
        lines.append(f"{name:<70}{k['count']:>7}{k['total_us']:>12.1f}"
                     f"{100 * k['fraction']:>7.1f}%")
    if m["device"] is None:
        lines.append("(no GPU kernels in the trace: a CPU run, or CUPTI recorded nothing)")
    if m["unattributed_kernels"]:
        lines.append(f"({m['unattributed_kernels']} kernels in the window not tied to a step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--out", help="folder for overlap.json and the PNGs (default: the "
                                      "trace's folder)")
    parser.add_argument("--device", type=int, help="GPU id (default: the lowest with kernels)")
    parser.add_argument("--timeline-steps", type=int, default=4)
    marked = parser.add_mutually_exclusive_group()
    marked.add_argument("--steps-with", metavar="RANGE",
                        help="count only the steps with an echo range of that name (e.g. "
                             "bitmask: the steps with structured outputs)")
    marked.add_argument("--steps-without", metavar="RANGE", help="only the steps without one")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    only = None
    if args.steps_with or args.steps_without:
        with_it = steps_marked(trace, args.steps_with or args.steps_without)
        only = with_it if args.steps_with else {
            r.step for r in trace.ranges if r.step is not None} - with_it
    metrics = compute_metrics(trace, args.device, only_steps=only)
    print(format_report(metrics))
    out = Path(args.out) if args.out else Path(args.trace).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "overlap.json").write_text(json.dumps(metrics, indent=2))
    try:
        from overlap_plots import plot_gaps, plot_timeline
    except ImportError as e:  # the GPU machine may lack matplotlib: the numbers still count
        print(f"no plots ({e})", file=sys.stderr)
    else:
        plot_timeline(trace, metrics, out / "timeline.png", args.timeline_steps)
        plot_gaps(metrics, out / "gaps.png")
    print(f"\nwrote {out / 'overlap.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
