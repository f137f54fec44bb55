"""PNGs for overlap_report.py: a timeline of a few steps, and a histogram of the idle gaps."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on the machines this runs on
import matplotlib.pyplot as plt  # noqa: E402
from trace_formats import Trace, kernel_steps  # noqa: E402

GPU_ROW = "GPU kernels"


def _color(step: int | None):
    return "0.6" if step is None else plt.cm.tab10(step % 10)


def plot_timeline(trace: Trace, metrics: dict, path: Path, num_steps: int = 4) -> None:
    """CPU ranges (a row per phase) above the GPU's kernels, for num_steps consecutive steps
    from the middle of the window, coloured by step."""
    device = metrics["device"]
    kernels = sorted((k for k in trace.kernels if k.device == device), key=lambda k: k.start)
    steps_of = kernel_steps(trace, kernels)
    steps = (sorted({s for s in steps_of if s is not None})
             # no kernels (a CPU run): the CPU ranges alone
             or sorted({r.step for r in trace.ranges if r.step is not None}))
    if not steps:
        return
    mid = max(0, len(steps) // 2 - num_steps // 2)
    chosen = set(steps[mid: mid + num_steps])
    mine = [(k, s) for k, s in zip(kernels, steps_of) if s in chosen]
    ranges = [r for r in trace.ranges if r.step in chosen]
    t0 = min([k.start for k, _ in mine] + [r.start for r in ranges])
    t1 = max([k.end for k, _ in mine] + [r.end for r in ranges])
    ranges += [r for r in trace.ranges if r.step is None and r.end > t0 and r.start < t1]
    names = list(metrics["cpu_ranges"]) or sorted({r.name for r in ranges})
    names += sorted({r.name for r in ranges} - set(names))
    rows = names + [GPU_ROW]

    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.5))
    y = {name: len(rows) - 1 - i for i, name in enumerate(rows)}
    for r in ranges:
        ax.broken_barh([((r.start - t0) / 1e3, (r.end - r.start) / 1e3)], (y[r.name] - 0.4, 0.8),
                       facecolors=_color(r.step))
    gpu = [(k, s) for k, s in zip(kernels, steps_of) if k.end > t0 and k.start < t1]
    ax.broken_barh([((k.start - t0) / 1e3, (k.end - k.start) / 1e3) for k, _ in gpu],
                   (y[GPU_ROW] - 0.4, 0.8), facecolors=[_color(s) for _, s in gpu])
    ax.set_yticks(list(y.values()), list(y))
    ax.set_xlabel("µs")
    ax.set_title(f"steps {min(chosen)}..{max(chosen)} ({metrics['source']} trace), colour = step")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gaps(metrics: dict, path: Path) -> None:
    values = metrics["gaps"].get("values_us", [])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(values, bins=min(50, max(5, len(values) // 2)) if values else 5)
    ax.set_xlabel("GPU idle between consecutive steps (µs)")
    ax.set_ylabel("step pairs")
    g = metrics["gaps"]
    if g["count"]:
        ax.set_title(f"p50 {g['p50_us']:.1f} µs, p99 {g['p99_us']:.1f} µs, "
                     f"{100 * g['fraction_of_step']:.1f}% of step time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
